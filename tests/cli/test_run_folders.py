"""Run folders (outputs.run_folder): an earlier run is set aside, put back or replaced as one transaction; what a
resume continues from is kept; and a run folder someone sent (docs/guarantees.md, "Files you did not make") can
neither run code through its checkpoint nor lead a read or write outside through a symbolic link."""
import pytest
import torch

from test_doors import EARLIER, _RunsCode, _assert_refused, _commands, _digest, _earlier_run, _images as door_images
from timm_tokcomp.files.outputs import run_folder


def test_run_folder_restores_sets_aside_and_finally_replaces(tmp_path, capsys):
    out = tmp_path / "run"
    before = _earlier_run(out, ["a.txt", "cache/x.npz", "report.md"])
    with pytest.raises(RuntimeError):  # fails before writing: everything comes back
        with run_folder(out, overwrite=True, run_entries=("*",)):
            assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == []
            raise RuntimeError
    assert _digest(out) == before
    with pytest.raises(KeyboardInterrupt):  # fails after writing: both stay, the earlier one set aside
        with run_folder(out, overwrite=True, run_entries=("*",)):
            (out / "a.txt").write_text("new\n")
            raise KeyboardInterrupt
    assert "kept in" in capsys.readouterr().err
    aside = [p for p in out.iterdir() if p.name.startswith(".replaced-")]
    assert len(aside) == 1 and (aside[0] / "report.md").read_text() == "earlier report.md\n"
    with pytest.raises(FileExistsError, match=r"\.replaced-"):  # a set-aside run still counts as something there
        with run_folder(out):
            pass
    with pytest.raises(KeyboardInterrupt):  # a second failed run in the same process sets aside separately
        with run_folder(out, overwrite=True, run_entries=("*",)):
            (out / "b.txt").write_text("newer\n")
            raise KeyboardInterrupt
    kept = sorted(p for p in out.iterdir() if p.name.startswith(".replaced-"))
    assert len(kept) == 2
    assert any((k / "report.md").read_text() == "earlier report.md\n" for k in kept if (k / "report.md").exists())
    with run_folder(out, overwrite=True, run_entries=("*",)):  # a run that ends: every set-aside run goes
        (out / "c.txt").write_text("final\n")
    assert sorted(p.name for p in out.iterdir()) == ["c.txt"]


def test_run_folder_resume_keeps_what_the_run_continues_from(tmp_path):
    out = tmp_path / "run"
    before = _earlier_run(out, ["cache/x.npz", "report.md", "plot.png"])
    with pytest.raises(ValueError):  # a failed resume puts the redrawn files back
        with run_folder(out, resume=True, run_entries=("*",), kept_on_resume=("cache",)):
            assert (out / "cache" / "x.npz").is_file() and not (out / "report.md").exists()
            raise ValueError
    assert _digest(out) == before
    with run_folder(out, resume=True, run_entries=("*",), kept_on_resume=("cache",)):
        (out / "report.md").write_text("new report\n")
    assert sorted(p.name for p in out.iterdir()) == ["cache", "report.md"]  # plot.png of the earlier settings gone
    assert (out / "report.md").read_text() == "new report\n"


@pytest.mark.parametrize("command", ["finetune", "train-tocom"])
def test_a_code_running_checkpoint_to_resume_runs_nothing(tmp_path, capsys, command):
    """A run folder someone sent: its training/checkpoint.pt runs a command when unpickled in full; --resume reads
    it with weights_only=True, so the command never runs and the file is refused in one line."""
    out = tmp_path / "out"
    _earlier_run(out, EARLIER[command])
    torch.save({"format": 4, "note": _RunsCode(tmp_path / "ran")}, out / "training" / "checkpoint.pt")
    data = door_images(tmp_path / "d", count=8, labels=[0, 1] * 4)
    argv = _commands(str(data), str(out))[command] + ["--resume"]
    if command == "train-tocom":
        argv += ["--batch-size", "2", "--holdout", "2"]
    _assert_refused(argv, capsys, "--resume", "training/checkpoint.pt", "nothing in it was run")
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("flag", ["--overwrite", "--resume"])
@pytest.mark.parametrize("command", list(EARLIER))
def test_a_symbolic_link_in_the_run_folder_is_refused_before_any_work(tmp_path, capsys, command, flag):
    """OUT/<entry> a link to another folder (a run folder someone sent): refused naming it, and nothing is written
    there or in the folder; a link planted among the package's hidden entries (.replaced-*) likewise."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    data = door_images(tmp_path / "d", count=8, labels=[0, 1] * 4)
    for link in (EARLIER[command][0].split("/")[0] + "_link", ".replaced-x"):
        out = tmp_path / f"out{link}"
        _earlier_run(out, EARLIER[command])
        (out / link).symlink_to(elsewhere, target_is_directory=True)
        before = _digest(out)
        _assert_refused(_commands(str(data), str(out))[command] + [flag], capsys, str(out / link),
                        "symbolic link")
        assert _digest(out) == before and not list(elsewhere.iterdir())


def test_a_run_never_writes_through_a_link(tmp_path):
    from timm_tokcomp.files.outputs import OutputError, write_text

    target = tmp_path / "target.txt"
    target.write_text("mine\n")
    (tmp_path / "out.csv").symlink_to(target)
    with pytest.raises(OutputError, match="symbolic link"):
        write_text(tmp_path / "out.csv", "theirs\n")
    assert target.read_text() == "mine\n"
