"""Benchmark of the dense variant (merge before the MLP, unmerge after): measured encoder speedup against
the ideal S* = 1 / (1 - f_mlp * k / N) and the efficiency eta = (T_u - T_v) / (T_u - T_u / S*), where
f_mlp is the measured share of encoder time spent in the MLPs of the unmodified model; plus the
per-block time of the MLP part, and of merge / unmerge alone with their memory bandwidth.

CPU (torch path, fp32):
    python examples/bench_dense.py
GPU (bf16, batch 32, torch reference path against the Triton kernels):
    python examples/bench_dense.py --device cuda --dtype bfloat16 --batch-size 32 --backends torch,triton
"""
import argparse
import copy
import statistics
import sys
import time
from typing import Callable, Dict, List

import timm
import torch
from torch import nn

import timm_tokcomp
from timm_tokcomp import kernels
from timm_tokcomp.ops.matching import bipartite_soft_matching
from timm_tokcomp.measure.timing import time_side_by_side
from timm_tokcomp.plans.merge import group_index

PEAK_GBPS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0}  # SXM memory bandwidth, GB/s


class Encoder(nn.Module):
    """The model's forward_features, so that timing covers the encoder only."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.forward_features(x)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def mlp_share(model: nn.Module, x: torch.Tensor, rounds: int) -> float:
    """Median share of forward_features time spent inside the blocks' MLPs (synchronised hooks)."""
    spent: List[float] = []
    start: Dict[int, float] = {}

    def pre(module, args):
        sync(x.device)
        start[id(module)] = time.perf_counter()

    def post(module, args, out):
        sync(x.device)
        spent.append(time.perf_counter() - start[id(module)])

    handles = [h for blk in model.blocks for h in (blk.mlp.register_forward_pre_hook(pre), blk.mlp.register_forward_hook(post))]
    shares = []
    for _ in range(rounds + 1):
        spent.clear()
        sync(x.device)
        t0 = time.perf_counter()
        model.forward_features(x)
        sync(x.device)
        shares.append(sum(spent) / (time.perf_counter() - t0))
    for h in handles:
        h.remove()
    return statistics.median(shares[1:])


@torch.inference_mode()
def median_time(fn: Callable[[], object], device: torch.device, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: List[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deit_base_patch16_384")
    p.add_argument("--img-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--rs", default="8,16", help="compression degrees r (k = 32 r merges per block)")
    p.add_argument("--backends", default="torch", help="comma list of torch, triton")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    base = timm.create_model(args.model, img_size=args.img_size).to(device, dtype).eval()
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=device, dtype=dtype)
    num_tokens = base.patch_embed.num_patches + base.num_prefix_tokens
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{args.model} at {args.img_size}px (N = {num_tokens}), batch {args.batch_size}, {args.dtype}, {name}")

    f_mlp = mlp_share(base, x, args.rounds)
    print(f"MLP share of encoder time (unmodified): f_mlp = {f_mlp:.3f}")

    rs = [int(r) for r in args.rs.split(",")]
    backends = args.backends.split(",")
    models = {"unmodified": Encoder(base)}
    for r in rs:
        for backend in backends:
            variant = timm_tokcomp.apply(copy.deepcopy(base), "dense_tome", r=r, kernel=backend)
            models[f"r={r} {backend}"] = Encoder(variant)
    seconds = time_side_by_side(models, x, rounds=args.rounds)
    t_u = seconds["unmodified"]
    print(f"\n{'variant':<16}{'k':>6}{'ms':>10}{'speedup':>9}{'S*':>8}{'eta':>7}")
    print(f"{'unmodified':<16}{0:>6}{1000 * t_u:>10.1f}{1.0:>8.2f}x")
    for r in rs:
        k = min(32 * r, (num_tokens - base.num_prefix_tokens) // 2)
        ideal = 1.0 / (1.0 - f_mlp * k / num_tokens)
        for backend in backends:
            t_v = seconds[f"r={r} {backend}"]
            eta = f"{(t_u - t_v) / (t_u - t_u / ideal):.2f}" if k > 0 else "-"  # no ideal saving at k = 0
            print(f"{f'r={r} {backend}':<16}{k:>6}{1000 * t_v:>10.1f}{t_u / t_v:>8.2f}x{ideal:>7.2f}x{eta:>7}")

    block_parts(base, x, rs, backends, args.rounds, name)


@torch.inference_mode()
def block_parts(base: nn.Module, x: torch.Tensor, rs: List[int], backends: List[str], rounds: int, name: str) -> None:
    """Time the MLP part of the first block (matching included), and the matching, merge and unmerge alone, on that
    block's real input. The merge alone is the merge kernel (triton: with the member lists the matching kernel
    wrote; torch: the group mean)."""
    device, num_tokens = x.device, base.patch_embed.num_patches + base.num_prefix_tokens
    blk = base.blocks[0]
    h = base.norm_pre(base.patch_drop(base._pos_embed(base.patch_embed(x))))
    h = h + blk.ls1(blk.attn(blk.norm1(h)))
    qkv = blk.attn.qkv(blk.norm1(h)).reshape(*h.shape[:2], 3, blk.attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    metric = qkv[1].mean(dim=1)
    gamma = blk.ls2.gamma if hasattr(blk.ls2, "gamma") else None
    plain_ms = 1000 * median_time(lambda: h + blk.ls2(blk.mlp(blk.norm2(h))), device, rounds)
    print(f"\nper block, MLP part: unmodified {plain_ms:.2f} ms")
    peak = next((v for k, v in PEAK_GBPS.items() if k in name), None)
    itemsize = h.element_size()
    for r in rs:
        k = 32 * r
        for backend in backends:
            if backend == "triton":  # the matching kernel also lists each group's members for the merge kernel
                def groups():
                    group, *members = kernels.tome_groups(metric, k, base.num_prefix_tokens)
                    return group, num_tokens - k, tuple(members)
            else:
                def groups():
                    return (*group_index(bipartite_soft_matching(metric, k, base.num_prefix_tokens), num_tokens),
                            None)
            match_s = median_time(groups, device, rounds)
            group, m, members = groups()
            merge_s = median_time(lambda: kernels.merge_normed(h, blk.norm2, group, m, backend, members), device, rounds)
            y = blk.mlp(kernels.merge_normed(h, blk.norm2, group, m, backend, members))
            unmerge_s = median_time(lambda: kernels.unmerge_add(h, y, group, gamma, backend), device, rounds)

            def part():
                group, m, members = groups()
                y = blk.mlp(kernels.merge_normed(h, blk.norm2, group, m, backend, members))
                return kernels.unmerge_add(h, y, group, gamma, backend)

            part_s = median_time(part, device, rounds)
            merge_gb = (h.numel() + y.numel()) * itemsize / 1e9  # read x, write y
            unmerge_gb = (2 * h.numel() + y.numel()) * itemsize / 1e9  # read x and y, write out
            line = (f"r={r} {backend:<7} MLP part {1000 * part_s:7.2f} ms (matching {1000 * match_s:6.3f} ms); merge "
                    f"{1000 * merge_s:6.3f} ms ({merge_gb / merge_s:7.1f} GB/s), unmerge {1000 * unmerge_s:6.3f} ms "
                    f"({unmerge_gb / unmerge_s:7.1f} GB/s)")
            if peak:
                line += f"; {merge_gb / merge_s / peak:.0%} / {unmerge_gb / unmerge_s / peak:.0%} of {peak:.0f} GB/s"
            print(line)

if __name__ == "__main__":
    main(sys.argv[1:])
