"""The fused kernels against the torch reference on one device, at DeiT-B's shapes (224 px, and 384 / 512 px
for the tiled paths), with both paths timed; ToMe's step on the keys also eagerly and compiled, and ToMe's and EViT's
rope steps (the rotary coordinates moved inside them) compiled (torch.compile of the step as a compiled forward runs
it: Inductor launching the kernels where Triton compiles them):

    python -m timm_tokcomp.commands.selfcheck --device cuda --dtypes fp32,bf16,fp16 [--batch 256] [--steps tome,evit]
                                             [--out check.json [--overwrite]]

On a GPU run it without TRITON_INTERPRET (the compiled kernels); on the CPU it needs TRITON_INTERPRET=1 and fp32
/ fp16 (the interpreter has no bf16), and its times are the interpreter's. Each step's inputs are rounded to the
dtype first; the reference then runs in fp32 on them, so a kernel in bf16 may differ only by its output's
rounding. Exit status 1 when any step is off by more than its tolerance.
"""
import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..utils.checks import MAX_BATCH, check_choice, flag_type, integer
from ..ops import dense_merge as ops
from ..plans.merge import group_index, merge_mean
from ..measure.precision import DTYPES, check_device
from ..files.outputs import new_output, refuse_existing
from ..utils.tables import text_table
from ..ops.matching import (attentive_pruning, batch_adaptive_r, best_matches, bipartite_soft_matching, class_attention,
                            count_above, max_merges, merge_top_r)

# on |kernel - reference| / max(1, |reference|): a kernel that rounds an intermediate to the dtype (as the torch path
# does) may be one unit in the last place off an output of magnitude 4 to 8, which is 2^-5 in bf16 and 2^-8 in fp16
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 4e-3}
STEP_KINDS = ("tome", "atm", "evit", "dense")  # the first word of each step's name (--steps)

BATCH = integer("--batch", 1, "(images per step)", high=MAX_BATCH)  # the checks of the flags
ROUNDS = integer("--rounds", 1)


@dataclass
class StepCheck:
    """One reduction step in one dtype: the largest |kernel - reference| / max(1, |reference|) over its outputs,
    the tolerance, and the median milliseconds of the torch path and of the kernels on the same inputs (None: not
    timed)."""

    step: str
    dtype: str
    max_diff: float
    tolerance: float
    torch_ms: Optional[float]
    triton_ms: Optional[float]

    @property
    def ok(self) -> bool:
        return self.max_diff <= self.tolerance


def _median_ms(fn: Callable[[], object], device: torch.device, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _diff(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """The largest |got - want| / max(1, |want|) over all outputs (absolute below magnitude 1, relative above)."""
    if len(got) != len(want):
        raise AssertionError(f"a step returned {len(got)} outputs where its reference returns {len(want)}")
    return max(float(((g.float() - w.float()).abs() / w.float().abs().clamp(min=1)).max()) for g, w in zip(got, want))


def _steps(batch: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Dict[str, Tuple[Callable, Callable, Callable]]:
    """step name -> (kernel (), reference in fp32 (), torch path in dtype ()), each returning its outputs."""
    from ..kernels import library, triton_dense, triton_evit, triton_tome

    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    def sizes(n):
        return torch.randint(1, 4, (batch, n, 1), generator=g).to(device, dtype)

    def same(t):
        return t

    def fp32(t):
        return t.float()

    def with_log(x, size):
        """A step's outputs as the kernels return them: the merged tokens, their sizes and the sizes' log."""
        return x, size, size.log()

    def tome(cast, metric, x, size, r):
        return with_log(*merge_mean(cast(x), cast(size), bipartite_soft_matching(cast(metric), r, 1)))

    def head_mean(k):
        """k (B, H, N, d) averaged over heads as the match kernel averages them: fp32 sum in head order, / H, in
        k's dtype (elementwise, so exact on every device)."""
        total = k[:, 0].float()
        for h in range(1, k.shape[1]):
            total = total + k[:, h].float()
        return (total / k.shape[1]).to(k.dtype)

    def atm(cast, metric, x, size, threshold):
        node_max, node_idx = best_matches(cast(metric), 1)
        r = min(batch_adaptive_r(count_above(node_max, threshold)), max_merges(metric.shape[1], 1))
        return with_log(*merge_mean(cast(x), cast(size), merge_top_r(node_max, node_idx, r, 1)))

    def evit(cast, q, k, x, size, bias, r):
        plan = attentive_pruning(class_attention(cast(q), cast(k), cast(bias), 0.125).mean(dim=1), r, 1)
        return with_log(*plan.apply(cast(x), cast(size), None)[:2])

    steps = {}  # each: (kernel, reference in fp32, torch path in the dtype), on the same inputs
    for tokens, r, label in ((197, 16, "tome r16, 197 tokens"), (1025, 256, "tome r256, 1025 tokens (tiled)")):
        args = (randn(batch, tokens, 64), randn(batch, tokens, 768), sizes(tokens), r)
        steps[label] = (partial(triton_tome.tome_merge, *args, 1), partial(tome, fp32, *args), partial(tome, same, *args))

    k, x, size = randn(batch, 12, 197, 64), randn(batch, 197, 768), sizes(197)
    on_mean = (head_mean(k), x, size, 16)
    steps["tome r16 on keys (B, 12, N, 64), 197 tokens"] = (
        partial(triton_tome.tome_merge, k, x, size, 16, 1), partial(tome, fp32, *on_mean),
        partial(tome, same, k.mean(dim=1), x, size, 16))
    def compiled(name):
        """The step `name` as a compiled forward runs it (kernels.library.compiled_step on the 'triton' backend)."""
        return torch.compile(partial(library.compiled_step, name, backend="triton"), dynamic=True)

    steps["tome r16 on keys compiled, 197 tokens"] = (
        partial(compiled("tome_merge"), k, x, size, 16, 1), partial(tome, fp32, *on_mean),
        partial(tome, same, k.mean(dim=1), x, size, 16))

    args = (randn(batch, 197, 64), randn(batch, 197, 768), sizes(197), 0.3)
    steps["atm threshold 0.3, 197 tokens"] = (partial(triton_tome.atm_merge, *args, 1, None), partial(atm, fp32, *args),
                                              partial(atm, same, *args))

    for tokens, r, label in ((197, 16, "evit r16, 197 tokens"), (577, 64, "evit r64, 577 tokens (tiled)")):
        q, k, x, size = randn(batch, 12, tokens, 64), randn(batch, 12, tokens, 64), randn(batch, tokens, 768), \
            sizes(tokens)
        bias = size.log().view(batch, 1, 1, tokens)
        args = (q, k, x, size, bias, r)
        steps[label] = (partial(triton_evit.evit_prune, q, k, bias, 0.125, x, size, r, 1),
                        partial(evit, fp32, *args), partial(evit, same, *args))

    # the rope steps compiled (their kernels launched by Inductor where Triton compiles them), the coordinates of a
    # 14 x 14 grid moved inside them: to ToMe's destinations, to EViT's fused token's weighted mean
    grid = torch.arange(14.0)
    coords = torch.stack(torch.meshgrid(grid, grid, indexing="ij"), dim=-1).reshape(1, 196, 2).repeat(batch, 1, 1)
    coords = coords.to(device)
    metric, x, size = randn(batch, 197, 64), randn(batch, 197, 768), sizes(197)
    tome_rope = partial(torch.ops.timm_tokcomp.tome_merge_rope, r=16, num_prefix=1, coords_merge="dst",
                        backend="torch")
    steps["tome r16 rope (dst) compiled, 197 tokens"] = (
        partial(compiled("tome_merge_rope"), metric, x, size, coords, 16, 1, "dst"),
        partial(tome_rope, fp32(metric), fp32(x), fp32(size), coords), partial(tome_rope, metric, x, size, coords))
    q, k = randn(batch, 12, 197, 64), randn(batch, 12, 197, 64)
    bias = size.log().view(batch, 1, 1, 197)
    evit_rope = partial(torch.ops.timm_tokcomp.evit_prune_rope, scale=0.125, r=16, num_prefix=1, coords_merge="dst",
                        backend="torch")
    steps["evit r16 rope compiled, 197 tokens"] = (
        partial(compiled("evit_prune_rope"), q, k, bias, 0.125, x, size, coords, 16, 1, "dst"),
        partial(evit_rope, fp32(q), fp32(k), fp32(bias), x=fp32(x), size=fp32(size), coords=coords),
        partial(evit_rope, q, k, bias, x=x, size=size, coords=coords))

    dense_batch = max(1, batch // 8)  # 512 px: 1025 tokens
    metric_d, x_d = randn(dense_batch, 1025, 64), randn(dense_batch, 1025, 768)
    weight, norm_bias = randn(768, scale=0.1) + 1, randn(768, scale=0.1)
    y_d = randn(dense_batch, 1025 - 256, 768)

    def dense_kernel():
        group, *members = triton_tome.tome_groups(metric_d, 256, 1)
        merged = triton_dense.merge(x_d, group, 1025 - 256, weight, norm_bias, 1e-6, tuple(members))
        return merged, triton_dense.unmerge_add(x_d, y_d, group)

    def dense(cast):
        x, y = cast(x_d), cast(y_d)
        group, m = group_index(bipartite_soft_matching(cast(metric_d), 256, 1), 1025)
        normed = torch.nn.functional.layer_norm(x, (768,), cast(weight), cast(norm_bias), 1e-6)
        return ops.group_mean(normed, group, m), ops.unmerge_add(x, y, group, None)

    steps[f"dense k256, 1025 tokens, batch {dense_batch}"] = (dense_kernel, partial(dense, fp32), partial(dense, same))
    return steps


@torch.inference_mode()
def run_checks(device: str = "cuda", dtypes: Sequence[str] = ("fp32", "bf16"), batch: int = 256, rounds: int = 20,
               time_steps: Optional[bool] = None, kinds: Sequence[str] = STEP_KINDS) -> List[StepCheck]:
    """Every step of the given kinds (STEP_KINDS) in every dtype: kernel against reference, and (time_steps, default
    on CUDA) both paths timed."""
    check_device(device)
    dev = torch.device(device)
    for name in dtypes:
        check_choice("--dtypes: each", name, DTYPES)
    for kind in kinds:
        check_choice("--steps: each", kind, STEP_KINDS)
    BATCH(batch)
    ROUNDS(rounds)
    time_steps = dev.type == "cuda" if time_steps is None else time_steps
    checks = []
    for name in dtypes:
        for step, (kernel, reference, torch_path) in _steps(batch, DTYPES[name], dev).items():
            if step.split()[0] not in kinds:
                continue
            diff = _diff(kernel(), reference())
            times = (_median_ms(torch_path, dev, rounds), _median_ms(kernel, dev, rounds)) if time_steps else (None, None)
            checks.append(StepCheck(step, name, diff, TOLERANCE[name], *times))
    return checks


def format_checks(checks: Sequence[StepCheck]) -> str:
    cells = []
    for c in checks:
        timing = ([f"{c.torch_ms:.3f}", f"{c.triton_ms:.3f}", f"{c.torch_ms / c.triton_ms:.2f}x"]
                  if c.torch_ms is not None else ["-", "-", "-"])
        cells.append([c.step, c.dtype, f"{c.max_diff:.2e}", f"{c.tolerance:.0e}", *timing, "" if c.ok else "OFF"])
    return "\n".join(text_table(["step", "dtype", "max diff", "tol", "torch ms", "triton ms", "speedup", ""], cells))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16, fp16 (default %(default)s)")
    p.add_argument("--batch", type=flag_type(BATCH), default=256,
                   help="images per step (dense: an eighth; default %(default)s)")
    p.add_argument("--rounds", type=flag_type(ROUNDS), default=20,
                   help="timed calls per path (median; default %(default)s)")
    p.add_argument("--steps", default=",".join(STEP_KINDS),
                   help="comma list of the steps to check: tome, atm, evit, dense (default: all)")
    p.add_argument("--no-timing", action="store_true", help="check only")
    p.add_argument("--out", help="also write the checks as JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        if args.out:
            refuse_existing(args.out, args.overwrite, "--out")  # before the checks: no work lost to a refusal
        check_device(args.device)
        if torch.device(args.device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--device cpu runs the kernels in Triton's interpreter, which must be on before Python "
                             "starts: TRITON_INTERPRET=1 python -m timm_tokcomp.commands.selfcheck --device cpu")
        checks = run_checks(args.device, args.dtypes.split(","), args.batch, args.rounds,
                            False if args.no_timing else None, args.steps.split(","))
    except (ValueError, FileExistsError) as err:
        p.error(str(err))
    name = torch.cuda.get_device_name(args.device) if torch.device(args.device).type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}\n{format_checks(checks)}")
    if args.out:
        with new_output(args.out, args.overwrite, "--out") as tmp, open(tmp, "w") as f:
            json.dump([{**asdict(c), "ok": c.ok} for c in checks], f, indent=1)
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
