"""`python -m timm_tokcomp.commands.selfcheck`, the GPU check of the fused kernels against their torch references, run here in
Triton's CPU interpreter (fp32, untimed)."""
import json
import subprocess
import sys

import pytest
import torch

from timm_tokcomp.commands import selfcheck
from timm_tokcomp.kernels import triton_tome
from timm_tokcomp.ops.matching import bipartite_soft_matching
from timm_tokcomp.plans.merge import merge_mean

pytestmark = [pytest.mark.slow]  # the kernels in Triton's interpreter


def test_selfcheck_compares_every_step_and_fails_loudly(tmp_path, monkeypatch, capsys):
    """`python -m timm_tokcomp.commands.selfcheck`, the GPU check of the kernels, run here in the interpreter (fp32,
    untimed): every step within tolerance; a step beyond it makes the exit status 1 (checked on ToMe's steps alone,
    --steps tome); bad dtypes and steps are refused."""
    out = tmp_path / "check.json"
    assert selfcheck.main(["--device", "cpu", "--dtypes", "fp32", "--batch", "1", "--no-timing", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    capsys.readouterr()
    with pytest.raises(SystemExit):  # an earlier report is not overwritten without --overwrite
        selfcheck.main(["--device", "cpu", "--dtypes", "fp32", "--batch", "1", "--no-timing", "--out", str(out)])
    assert f"--out {out} already exists; pass --overwrite to replace it" in capsys.readouterr().err
    assert json.loads(out.read_text()) == rows
    assert [r["step"].split(",")[0] for r in rows] == ["tome r16", "tome r256", "tome r16 on keys (B",
                                                       "tome r16 on keys compiled", "atm threshold 0.3", "evit r16",
                                                       "evit r64", "tome r16 rope (dst) compiled",
                                                       "evit r16 rope compiled", "dense k256"]
    assert all(r["ok"] and r["max_diff"] <= 1e-5 for r in rows)
    def off(metric, x, size, r, p):  # the tokens off by 1e-3; their sizes and the sizes' log right
        merged, merged_size = merge_mean(x * 1.001, size, bipartite_soft_matching(
            metric.mean(1) if metric.dim() == 4 else metric, r, p))
        return merged, merged_size, merged_size.log()

    monkeypatch.setattr(triton_tome, "tome_merge", off)
    assert selfcheck.main(["--device", "cpu", "--dtypes", "fp32", "--batch", "1", "--no-timing", "--steps",
                           "tome"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines if " fp32 " in line] == [
        "tome r16", "tome r256", "tome r16 on keys (B", "tome r16 on keys compiled", "tome r16 rope (dst) compiled"]
    flagged = [line.split(",")[0] for line in lines if line.endswith("OFF")]
    assert flagged == ["tome r16", "tome r256", "tome r16 on keys (B", "tome r16 on keys compiled"]
    with pytest.raises(SystemExit):
        selfcheck.main(["--device", "cpu", "--dtypes", "fp32", "--steps", "tome,merge"])
    assert "--steps: each must be one of tome, atm, evit, dense, got 'merge'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        selfcheck.main(["--device", "cpu", "--dtypes", "fp8"])
    assert "--dtypes: each must be one of fp32, bf16, fp16" in capsys.readouterr().err
    if not torch.cuda.is_available():  # a device the machine lacks: one error line, no traceback
        with pytest.raises(SystemExit):
            selfcheck.main(["--device", "cuda", "--dtypes", "fp32"])
        assert "--device cuda: CUDA is not available on this machine" in \
            capsys.readouterr().err.strip().splitlines()[-1]


def test_selfcheck_measures_errors_relative_above_magnitude_one():
    """One bf16 unit in the last place of an output in [4, 8) (2^-5, what rounding an intermediate costs, seen on an
    H200) is within the bf16 tolerance; the same absolute error on an output below 1 is not."""
    want = torch.tensor([4.0, 0.5])
    assert selfcheck._diff([torch.tensor([4.0 + 2 ** -5, 0.5])], [want]) == pytest.approx(2 ** -5 / 4)
    assert selfcheck._diff([torch.tensor([4.0 + 2 ** -5, 0.5])], [want]) <= selfcheck.TOLERANCE["bf16"]
    assert selfcheck._diff([torch.tensor([4.0, 0.5 + 2 ** -5])], [want]) == pytest.approx(2 ** -5)
    assert selfcheck._diff([torch.tensor([4.0, 0.5 + 2 ** -5])], [want]) > selfcheck.TOLERANCE["bf16"]


def test_selfcheck_runs_by_the_gpu_kits_name():
    """The shared GPU kit's part 1 runs the first of `timm_tokcomp.commands.selfcheck`, `timm_tokcomp.selfcheck`,
    `timm_tokcomp.kernels.selfcheck` that exists, with `python -m`: the first is the command (here its refusal of a
    bad --dtypes, which runs no check)."""
    done = subprocess.run([sys.executable, "-m", "timm_tokcomp.commands.selfcheck", "--device", "cpu", "--dtypes",
                           "fp8"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--dtypes: each must be one of fp32, bf16, fp16" in done.stderr
