"""Every input bounded before it costs (docs/guarantees.md, "Bounds"): tiny files built here from bytes that declare
huge things (compressed zeros, huge array headers, 5,000-digit numbers, 100,000-deep nesting, millions of blocks),
special files and links, huge flag values and environment variables. Each is one error line naming the file or the
flag, exit 2, nothing written, before the cost."""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import timm_tokcomp
from conftest import SMALL
from timm_tokcomp.cli import main
from timm_tokcomp.commands.analyze.record import Recording
from timm_tokcomp.files import bounded
from timm_tokcomp.files.data import open_dataset, open_images
from timm_tokcomp.files.userfiles import UserFileError, read_json, read_torch
from timm_tokcomp.methods.learned import load_learned
from timm_tokcomp.methods.register import register_method

MODEL = "deit_tiny_patch16_224"
DEEP = "[" * 100_000 + "]" * 100_000
DIGITS = "9" * 5000


def _refused(argv, capsys, *named):
    """main(argv) exits 2 with one 'tokcomp: error:' line (no traceback) naming each of `named`."""
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("tokcomp: error:") and all(n in err[0] for n in named), err
    return err[0]


def _images(folder: Path, count: int = 4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
    return folder


# ------------------------------------------------------------------ compressed containers


def _zip_bomb(path: Path, unpacked: int) -> Path:
    """A real torch checkpoint's members, deflated, plus one member of `unpacked` zero bytes (a few kB on disk)."""
    small = path.with_suffix(".small")
    torch.save({"w": torch.zeros(2)}, small)
    with zipfile.ZipFile(small) as source, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as bomb:
        for info in source.infolist():
            bomb.writestr(info.filename, source.read(info))
        with bomb.open("archive/data/9", "w", force_zip64=True) as member:
            chunk = bytes(1 << 24)
            for _ in range(unpacked // len(chunk)):
                member.write(chunk)
    assert path.stat().st_size < unpacked // 500
    return path


def test_a_compressed_checkpoint_is_refused_from_its_zip_directory(tmp_path, capsys):
    bomb = _zip_bomb(tmp_path / "bomb.pt", 256 << 20)
    with pytest.raises(UserFileError, match=r"^--checkpoint .*bomb\.pt is a [\d,]+-byte archive whose members unpack "
                                            r"to 268,4[\d,]+ bytes .* refused before decompressing"):
        read_torch(bomb, "--checkpoint")
    _refused(["bench", MODEL, "--checkpoint", str(bomb), "--methods", "none", "--no-timing"], capsys,
             "--checkpoint", str(bomb), "refused before decompressing")
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(3)}, plain)
    assert torch.equal(read_torch(plain)["w"], torch.ones(3))  # what torch.save writes passes


@pytest.mark.slow  # two interpreters, torch imported in each
def test_a_compressed_checkpoint_costs_no_memory_beyond_a_normal_run(tmp_path):
    """Peak memory of refusing 512 MiB of compressed zeros, against reading a small checkpoint: within 200 MB."""
    bomb, plain = _zip_bomb(tmp_path / "bomb.pt", 512 << 20), tmp_path / "plain.pt"
    torch.save({"w": torch.ones(3)}, plain)
    probe = ("import resource, sys\nfrom timm_tokcomp.files.userfiles import read_torch\ntry:\n"
             "    read_torch(sys.argv[1])\nexcept ValueError:\n    pass\n"
             "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    peak = {name: int(subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True,
                                     check=True).stdout) for name, path in (("bomb", bomb), ("plain", plain))}
    assert peak["bomb"] - peak["plain"] < 200 * 1024, peak  # kB


def _npz(path: Path, declared_shape) -> Path:
    """A recording archive whose 'assign' member's header declares declared_shape over a few bytes of data."""
    np.savez(path, assign=np.zeros((2, 2), np.int16), depth=np.zeros((2, 4), np.uint8),
             features=np.zeros((2, 3), np.float32), grid=np.array((2, 2)), meta=np.array('{"method": "tome_r8"}'))
    with zipfile.ZipFile(path) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    header = members["assign.npy"]
    fake = np.lib.format.header_data_from_array_1_0(np.zeros((2, 2), np.int16))
    fake["shape"] = declared_shape
    buffer = __import__("io").BytesIO()
    np.lib.format.write_array_header_1_0(buffer, fake)
    members["assign.npy"] = buffer.getvalue() + header[-8:]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_an_npz_member_declaring_a_huge_array_is_refused_from_its_header(tmp_path):
    path = _npz(tmp_path / "rec.npz", (100_000, 100_000, 100))
    with pytest.raises(UserFileError, match=r"member 'assign.npy' declares a \(100000, 100000, 100\) int16 array "
                                            r"\(2,000,000,000,000 bytes\) in \d+ bytes: refused before reading"):
        bounded.npz_shapes(path, 1 << 30, "--resume")
    assert Recording.load_if(path, "tome_r8", {}, 1 << 30) is None  # analyze --resume records it again


# ------------------------------------------------------------------ JSON: digits, nesting, size


def _preset(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text,problem", [
    (f'{{"format": 1, "method": "tome", "params": {{"r": {DIGITS}}}}}', "a number of 5,000 characters"),
    (f'{{"format": 1, "method": "tome", "params": {{"r": {DEEP}}}}}', "nested 100,002 levels deep"),
])
def test_json_digits_and_nesting_are_refused_naming_the_file(tmp_path, capsys, text, problem):
    path = _preset(tmp_path, text)
    with pytest.raises(UserFileError, match=f"^preset file {path} .*{problem}"):
        timm_tokcomp.load_preset(str(path))
    _refused(["bench", MODEL, "--methods", f"none,{path}", "--no-timing"], capsys, str(path), problem)


def test_json_nesting_inside_strings_does_not_count():
    assert read_json  # the reader every JSON file passes
    assert bounded.json_bounds(json.dumps({"a": "[" * 1000 + "9" * 500})) is None
    assert bounded.json_bounds("[" * 64 + "]" * 64) is None and "65 levels" in bounded.json_bounds("[" * 65 + "]" * 65)


def test_a_deep_hf_config_is_one_line_naming_the_file(tmp_path, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["ViTModel"], "x": ' + DEEP + "}")
    save_file({"w": torch.zeros(1)}, str(folder / "model.safetensors"))
    _refused(["bench", "--hf-model", str(folder), "--methods", "none", "--no-timing"], capsys,
             "--hf-model", "config.json", "nested 100,001 levels deep")


def test_a_deep_method_arg_is_one_line_naming_the_flag(tmp_path, capsys):
    _refused(["finetune", MODEL, "--data", str(_images(tmp_path / "d")), "--out", str(tmp_path / "o"), "--method",
              "tome_r8", "--method-arg", f"r={DEEP}"], capsys, "--method-arg r=", "nested 100,000 levels deep")
    assert not (tmp_path / "o").exists()


def test_a_json_file_over_its_size_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = _preset(tmp_path, json.dumps({"pad": "x" * 2000}))
    monkeypatch.setattr(bounded, "MAX_JSON_BYTES", 1000)
    with pytest.raises(UserFileError, match=r"is [\d,]+ bytes, over the 1,000 a JSON file may take"):
        bounded.read_json(path, "preset file")


def test_a_tune_csv_cell_of_deep_json_is_refused_naming_the_file_and_line(tmp_path):
    from dataclasses import fields

    from timm_tokcomp.commands.tune import read_rows
    from timm_tokcomp.commands.tune.rows import TuneRow

    names = [f.name for f in fields(TuneRow)]
    row = {n: "" for n in names} | {"batch": "1", "mode": "eager", "candidate": "c", "setting": "s", "path": "p",
                                    "method": "tome", "params": "[" * 5000 + "]" * 5000, "status": "waiting",
                                    "chosen": "False"}
    path = tmp_path / "tune.csv"
    path.write_text(",".join(names) + "\n" + ",".join(row[n] for n in names) + "\n")
    with pytest.raises(UserFileError, match=r"^--resume .*tune\.csv cannot be read as tune's CSV: line 2: its params "
                                            r"is nested 5,000 levels deep"):
        read_rows(path)


def test_a_fifo_lock_in_a_run_folder_is_taken_over_not_waited_on(tmp_path):
    from timm_tokcomp.files.outputs import run_lock

    _fifo(tmp_path / ".lock")
    with run_lock(tmp_path):
        assert (tmp_path / ".lock").read_text() == str(os.getpid())


# ------------------------------------------------------------------ declared sizes


def test_a_compensator_declaring_millions_of_blocks_is_refused_before_any_loop(tmp_path):
    from timm_tokcomp.tocom import load

    folder = tmp_path / "tocom"
    folder.mkdir()
    (folder / "tocom_config.json").write_text(json.dumps(
        {"format_version": 1, "depth": 30_000_000, "width": SMALL["embed_dim"], "attn_dim": SMALL["embed_dim"],
         "rank_per_projection": 4, "groups": 1, "subfolders": ["step_00"], "scale": 1.0}))
    with pytest.raises(ValueError, match=r"tocom_config.json: depth 30,000,000 is over the 1,024 a compensator may"):
        load(str(folder))


def test_a_learned_config_listing_20000_blocks_is_refused_before_it_is_built(tmp_path):
    folder = tmp_path / "learned"
    folder.mkdir()
    (folder / "pyra_config.json").write_text(json.dumps(
        {"format_version": 1, "method": "pyra", "dim": 192, "ranks": [1] * 20_000, "form": "paper"}))
    save_file({"w": torch.zeros(1)}, str(folder / "pyra.safetensors"))
    with pytest.raises(ValueError, match=r"pyra_config.json: ranks must list at most 1,024"):
        load_learned("pyra", folder)


# ------------------------------------------------------------------ labels and image folders


@pytest.mark.parametrize("label,shown", [("\u00b9", "'\u00b9'"), (DIGITS, "... (5,002 characters)")])
def test_a_bad_label_names_the_file_the_line_and_the_value(tmp_path, label, shown):
    folder = _images(tmp_path / "d")
    (folder / "labels.csv").write_text(f"file,label\nimg0.png,1\nimg1.png,{label}\n")
    with pytest.raises(UserFileError, match=r"labels\.csv, line 3: label .* is not a class index") as e:
        open_dataset(folder, lambda x: x)
    assert shown in str(e.value) and len(str(e.value)) < 400


def test_the_limit_applies_before_per_row_work(tmp_path):
    """A labels.csv of 100,000 rows, every one after the first four naming a path outside: --limit 4 reads four."""
    folder = _images(tmp_path / "d")
    rows = [f"img{i}.png,{i}" for i in range(4)] + ["../outside.png,0"] * 100_000
    (folder / "labels.csv").write_text("file,label\n" + "\n".join(rows) + "\n")
    assert len(open_dataset(folder, lambda x: x, limit=4)) == 4
    with pytest.raises(UserFileError, match=r"names '\.\./outside\.png', outside"):
        open_dataset(folder, lambda x: x, limit=5)


@pytest.mark.parametrize("layout", ["plain", "tree", "tree-folder"])
def test_a_link_leading_out_of_data_is_refused_in_every_layout(tmp_path, layout):
    outside = _images(tmp_path / "outside", 1)
    data = tmp_path / "data"
    if layout == "plain":
        _images(data)
        (data / "zz.png").symlink_to(outside / "img0.png")
    elif layout == "tree":
        _images(data / "cat")
        (data / "cat" / "zz.png").symlink_to(outside / "img0.png")
    else:
        _images(data / "cat")
        (data / "dog").symlink_to(outside, target_is_directory=True)
    with pytest.raises(UserFileError, match=r"a symbolic link leading outside .*nothing outside the folder is read"):
        open_images(data, lambda x: x)
    inside = tmp_path / "inside"  # a link within the folder is read
    _images(inside)
    (inside / "zz.png").symlink_to(inside / "img0.png")
    assert len(open_images(inside, lambda x: x)) == 5


# ------------------------------------------------------------------ special files


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def test_a_fifo_or_a_device_is_refused_before_it_is_opened(tmp_path, capsys):
    fifo = _fifo(tmp_path / "p.json")
    with pytest.raises(UserFileError, match=r"is a FIFO \(named pipe\), not a regular file"):
        timm_tokcomp.load_preset(str(fifo))  # would wait for a writer forever if it were opened
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    with pytest.raises(UserFileError, match=r"zero\.json is a character device, not a regular file"):
        timm_tokcomp.load_preset(str(zero))
    _refused(["bench", MODEL, "--methods", f"none,{fifo}", "--no-timing"], capsys, str(fifo), "FIFO")
    folder = _images(tmp_path / "d")
    _fifo(folder / "a.png")
    (folder / "labels.csv").write_text("file,label\na.png,0\nimg0.png,0\n")
    with pytest.raises(UserFileError, match=r"a\.png is a FIFO"):
        open_dataset(folder, lambda x: x)


# ------------------------------------------------------------------ flags and environment variables


def test_huge_batches_are_refused_by_the_flag_and_nothing_is_written(tmp_path, capsys):
    _refused(["speed", MODEL, "--batches", "1000000000000"], capsys, "--batches", "in [1, 65,536]")
    _refused(["tune", MODEL, "--data", str(tmp_path), "--out", str(tmp_path / "o"), "--batches", "1000000000000"],
             capsys, "--batches")
    _refused(["bench", MODEL, "--batch-size", "100000000000000000000"], capsys, "--batch-size",
             "in [1, 65,536]")
    assert not (tmp_path / "o").exists()


def test_a_batch_over_the_memory_is_refused_naming_the_flag(tmp_path, capsys, monkeypatch):
    from timm_tokcomp.utils import memory

    monkeypatch.setattr(memory, "device_memory", lambda device: 8 << 30)
    _refused(["speed", MODEL, "--batches", "60000", "--methods", "tome_r8"], capsys, "--batches 60,000",
             "GiB before any activation, over half of the 8 GiB")
    _refused(["bench", MODEL, "--batch-size", "60000", "--methods", "none", "--no-timing"], capsys,
             "--batch-size 60,000")
    _refused(["tune", MODEL, "--data", str(_images(tmp_path / "d")), "--out", str(tmp_path / "o"), "--batches",
              "60000"], capsys, "--batches 60,000")
    assert not (tmp_path / "o").exists()


def test_a_bad_environment_variable_is_named_not_the_image(tmp_path, monkeypatch):
    folder = _images(tmp_path / "d")
    for bad in ("abc", "0", DIGITS):
        monkeypatch.setenv("TOKCOMP_MAX_IMAGE_PIXELS", bad)
        with pytest.raises(ValueError, match=r"^the environment variable TOKCOMP_MAX_IMAGE_PIXELS must be an integer"):
            open_images(folder, lambda x: x)


# ------------------------------------------------------------------ method names


@pytest.mark.parametrize("name", ["", "none", "plain", "Tome", "to-me"])
def test_register_method_refuses_empty_reserved_and_untaggable_names(name):
    cls = type("Named", (), {"name": name})
    with pytest.raises(ValueError, match="a method's name must be a lower-case identifier"):
        register_method(cls)


# ------------------------------------------------------------------ one door


PACKAGE = Path(timm_tokcomp.__file__).parent
RAW_READS = __import__("re").compile(
    r"\.read_text\(|\.read_bytes\(|json\.loads?\(|torch\.load\(|np\.load\(|Image\.open\(|safe_open\(|load_file\(")
# the modules that read files past the door, each after its check: bounded itself, the torch / safetensors readers
# after regular_file and check_torch_zip, images after regular_file, an .npz after npz_shapes; and the package's own
# files (its assets, a staging folder it wrote, JSON it wrote itself in this process)
READERS = {"files/bounded.py", "files/userfiles.py", "files/data.py", "commands/analyze/record.py"}
OWN_FILES = {"tocom/hub.py": 2, "measure/device_table.py": 1, "commands/tune/report.py": 1, "commands/tune/run.py": 1,
             "commands/tune/store.py": 1, "cli/finetune.py": 1}


def test_every_file_is_read_through_the_door():
    """No module outside the readers calls a raw reader, except on the package's own files (counted, so a new
    one fails here until it goes through files.bounded)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name in READERS:
            continue
        lines = [line for line in path.read_text().splitlines() if RAW_READS.search(line.split("#")[0])]
        if lines:
            found[name] = len(lines)
    assert found == OWN_FILES, found
