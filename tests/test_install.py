"""The core install: with the optional packages unimportable (as after `pip install timm-tokcomp`), apply, the
registered names, bench and ToCom loading work, and each optional feature fails at once with one error that
names the extra to install."""
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow]  # builds and installs the package


OPTIONAL = ("peft", "matplotlib", "scipy", "sklearn", "onnx", "onnxscript", "onnxruntime", "transformers")
BLOCK = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in OPTIONAL)  # import raises ImportError


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=300)


def test_the_core_install_runs_apply_the_names_and_bench(tmp_path):
    done = _run(f"""
import timm, torch, timm_tokcomp
from timm_tokcomp.commands.bench import run_bench
from timm_tokcomp.deployment.specs import parse_methods
from timm_tokcomp.cli import main
from timm_tokcomp.tocom import Compensator, load

model = timm.create_model("deit_tiny_patch16_224.tome_r8")
plain = timm_tokcomp.apply(timm.create_model("deit_tiny_patch16_224"), "tome", r=4)
assert timm_tokcomp.get_reducer(model).params["r"] == 8 and timm_tokcomp.is_reduced(plain)
rows = run_bench("deit_tiny_patch16_224", parse_methods("none,tome_r8"), batch_size=2, timing_rounds=1, latency_runs=0,
                 show_progress=False)
assert rows[1].gmacs < rows[0].gmacs
assert main(["bench", "deit_tiny_patch16_224", "--methods", "none,tome_r8", "--batch-size", "2", "--rounds",
             "1", "--latency-runs", "0", "--no-progress", "--out", {str(tmp_path / "b.csv")!r}]) == 0
assert "peft" not in sys.modules or sys.modules["peft"] is None
print("core ok")
""")
    assert done.returncode == 0 and "core ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("code, extra", [
    ("from timm_tokcomp.tocom import Compensator, save\nsave(Compensator.init(2, 12, 192, 192), OUT, 'm')", "tocom"),
    ("from timm_tokcomp.training import finetune\nfinetune('deit_tiny_patch16_224', OUT, OUT + '/o')", "train"),
    ("from timm_tokcomp.cli import main\nsys.exit(main(['bench', '--plot', OUT + '/p.png']))", "plot"),
    ("from timm_tokcomp.cli import main\nsys.exit(main(['analyze', 'deit_tiny_patch16_224', '--methods', 'tome_r8,evit_r8', "
     "'--data', OUT, '--out', OUT + '/a']))", "analysis"),
    ("from timm_tokcomp.cli import main\nsys.exit(main(['train-tocom', 'deit_tiny_patch16_224', '--data', "
     "OUT, '--out', OUT + '/t']))", "tocom"),
])
def test_a_missing_extra_is_named_before_any_work(tmp_path, code, extra):
    done = _run(f"OUT = {str(tmp_path)!r}\n" + code)
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert f"[{extra}]' (this checkout's {extra} extra), or pip install " in message, done.stderr[-2000:]
    assert not any(p.name in ("o", "a", "t", "p.png") for p in tmp_path.iterdir())


def test_every_extra_installs_as_the_docs_spell_it_with_any_pip():
    """pip before 23.3 compares a requested extra with the metadata's Provides-Extra without normalising it, and
    setuptools writes the normalised name (`open_clip` -> `open-clip`): an extra must already be its normalised
    name, and every `[extra]` the docs and messages spell must be one the built metadata provides."""
    import re
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from importlib.metadata import metadata
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert all(re.sub(r"[-_.]+", "-", name).lower() == name for name in declared), sorted(declared)
    provided = set(metadata("timm-tokcomp").get_all("Provides-Extra"))
    assert provided == set(declared), "the installed metadata is stale: pip install -e . again"
    texts = [p.read_text() for p in [root / "README.md", *(root / "docs").glob("*.md"), *(root / "tests").rglob("*.py"),
                                     *(root / "timm_tokcomp").rglob("*.py")]]
    spelled = {e for t in texts for group in re.findall(r"timm[-_]tokcomp\[([a-z_,.-]+)\]", t)
               for e in group.split(",")}
    spelled |= set(re.findall(r'require\("[\w.]+", "([\w-]+)"', "\n".join(texts)))
    spelled |= {e for t in texts for group in re.findall(r"\.\[([a-z_,.-]+)\]", t) for e in group.split(",")}
    readme = (root / "README.md").read_text()
    table = readme.split("| extra | brings | for |")[1].split("\n\n")[0]
    spelled |= {e for row in re.findall(r"^\| ([^|]+) \|", table, re.M) for e in re.findall(r"`([\w-]+)`", row)}
    assert spelled and spelled <= provided, sorted(spelled - provided)
