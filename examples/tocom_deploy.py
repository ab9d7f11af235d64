"""Deployment story: one DeiT-Tiny serves a changing load by switching ToMe r between 0, 8 and 16,
first plainly, then with the ToCom compensator (same r, same cost).

    D=$TOKCOMP_DATA      # the evaluation data folder (CONTRIBUTING.md)
    python examples/tocom_deploy.py --checkpoint $D/deit_tiny_patch16_224.safetensors \\
        --data $D/imagenet-val-1300 --limit 512
    python examples/tocom_deploy.py          # random weights and images: runs offline, numbers meaningless

The load trace is in multiples of the unmodified model's throughput; each phase picks the smallest r
in --rs whose measured throughput covers it (the largest r when none does).
"""
import argparse
import time
from pathlib import Path
from typing import Dict, List, Optional

import timm
import torch

import timm_tokcomp
from timm_tokcomp.files.data import open_dataset
from timm_tokcomp.tocom import attach, detach, load, set_compression

DEFAULT_TOCOM = Path(__file__).resolve().parents[1] / "hub_cards" / "deit_tiny_patch16_224-tocom"


def images_and_labels(model: torch.nn.Module, data: Optional[str], limit: int, batch_size: int):
    """Batches of (images, labels or None): from data, or random images."""
    if data is None:
        torch.manual_seed(0)
        return [(torch.randn(batch_size, 3, 224, 224), None) for _ in range(max(1, limit // batch_size))]
    dataset = open_dataset(data, timm.data.create_transform(**timm.data.resolve_model_data_config(model)))
    subset = torch.utils.data.Subset(dataset, range(min(limit, len(dataset))))
    return list(torch.utils.data.DataLoader(subset, batch_size=batch_size))


@torch.inference_mode()
def run_phase(model: torch.nn.Module, batches, reference: List[torch.Tensor]) -> Dict[str, float]:
    """Agreement with the unmodified model's predictions and top-1 (percent; None without labels), img/s."""
    agree = correct = seen = 0
    start = time.perf_counter()
    for (x, y), ref in zip(batches, reference):
        pred = model(x).argmax(-1)
        agree += (pred == ref).sum().item()
        correct += 0 if y is None else (pred == y).sum().item()
        seen += len(x)
    seconds = time.perf_counter() - start
    return {"agreement": 100 * agree / seen, "top1": None if batches[0][1] is None else 100 * correct / seen,
            "img_per_s": seen / seconds}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deit_tiny_patch16_224")
    parser.add_argument("--checkpoint", help="weights file; without it, random weights")
    parser.add_argument("--data", help="labelled images (labels.csv folder or ImageFolder); without it, random images")
    parser.add_argument("--tocom", default=str(DEFAULT_TOCOM), help="compensator folder or Hub repo")
    parser.add_argument("--limit", type=int, default=256, help="images per phase")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rs", default="0,8,16", help="the r values the server may switch between")
    parser.add_argument("--loads", default="0.4,1.2,1.6,1.2,0.4",
                        help="load trace, as multiples of the unmodified model's throughput")
    args = parser.parse_args(argv)
    rs = sorted(int(r) for r in args.rs.split(","))
    loads = [float(v) for v in args.loads.split(",")]

    model = timm.create_model(args.model).eval()
    if args.checkpoint:
        timm.models.load_checkpoint(model, args.checkpoint, strict=True)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    batches = images_and_labels(model, args.data, args.limit, args.batch_size)
    with torch.inference_mode():
        reference = [model(x).argmax(-1) for x, _ in batches]

    timm_tokcomp.apply(model, "tome", r=0)
    capacity = {}
    for r in rs:  # measured throughput of each r decides what each load needs
        timm_tokcomp.set_params(model, r=r)
        capacity[r] = run_phase(model, batches[:1], reference[:1])["img_per_s"]
    base = capacity[rs[0]]
    print("throughput: " + ", ".join(f"r={r}: {v:.0f} img/s ({v / base:.2f}x)" for r, v in capacity.items()))

    compensator, config = load(args.tocom)
    print(f"compensator: {args.tocom} (scale {compensator.scale:g}, trained with {config['method']})")
    header = f"{'phase':>5} {'load':>6} {'r':>3} {'switch ms':>10} {'agree %':>8} {'top-1 %':>8}"
    for with_tocom in (False, True):
        print(f"\n{'with' if with_tocom else 'without'} ToCom\n{header}")
        if with_tocom:
            attach(model, compensator, source_r=0)
        for phase, load_factor in enumerate(loads):
            r = next((r for r in rs if capacity[r] >= load_factor * base), rs[-1])
            start = time.perf_counter()
            if with_tocom:
                set_compression(model, r=r)  # method r and compensated q / v weights
            else:
                timm_tokcomp.set_params(model, r=r)
            switch_ms = 1000 * (time.perf_counter() - start)
            result = run_phase(model, batches, reference)
            top1 = "-" if result["top1"] is None else f"{result['top1']:.2f}"
            print(f"{phase:>5} {load_factor:>5.1f}x {r:>3} {switch_ms:>10.1f} {result['agreement']:>8.2f} {top1:>8}")
    detach(model)
    timm_tokcomp.remove(model)
    same = all(torch.equal(v, original[k]) for k, v in model.state_dict().items())
    print(f"\nafter detach + remove the weights are {'bit-identical to' if same else 'DIFFERENT from'} the original")


if __name__ == "__main__":
    main()
