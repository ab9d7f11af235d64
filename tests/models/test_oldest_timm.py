"""The oldest timm pyproject.toml accepts, beside the newest the rest of the suite runs on: the package imports, the
timm adapter registers the method-tagged names without a warning, a ViT reduces (r = 0 is timm's model bit for bit),
and a model with rotary position embeddings, which needs a newer timm, is refused by name."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]  # why: installs that timm (a wheel pip caches) and imports torch in a fresh process

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import timm_tokcomp
    import timm
assert timm.__version__ == "{version}", timm.__version__
said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
assert not said, said
import torch
model = timm.create_model("deit_tiny.tome_r8")
assert type(model).__name__ == "ReducingVisionTransformer" and timm_tokcomp.get_reducer(model).r == 8
plain = timm.create_model("vit_tiny_patch16_224").eval()
x = torch.randn(2, 3, 224, 224)
with torch.no_grad():
    expected = plain(x)
    timm_tokcomp.apply(plain, "tome", r=0)
    assert torch.equal(plain(x), expected)
    timm_tokcomp.set_params(plain, r=8)
    plain(x)
    assert timm_tokcomp.last_stats(plain).tokens_per_block[-1] == 197 - 11 * 8
try:
    timm_tokcomp.apply(timm.create_model("eva02_tiny_patch14_224"), "tome", r=2)
except TypeError as e:
    assert "timm >= 1.0.31" in str(e) and "this is timm {version}" in str(e), e
else:
    raise AssertionError("a rope model was reduced on timm {version}")
print("ok")
"""


def oldest_timm() -> str:
    found = re.search(r'"timm>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert found, "pyproject.toml names no timm floor"
    return found.group(1)


def test_the_oldest_timm_accepted_registers_the_names_and_reduces_a_vit(tmp_path):
    version = oldest_timm()
    target = tmp_path / "timm"
    got = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                          f"timm=={version}"], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"pip could not install timm {version} here (no package index?): {got.stderr.strip()[-300:]}")
    env = {"PYTHONPATH": f"{target}{':' + str(ROOT)}", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", SCRIPT.format(version=version)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
