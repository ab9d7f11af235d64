"""The study's training-free methods compared image by image on both labelled sets ("Which Tokens to Use?"
protocol, real DeiT-Tiny, no fine-tuning): for each pair of methods at a keep rate, the images only the first
gets right, the images only the second gets right, and the exact McNemar p; per set and pooled.

    python examples/study_paired.py --data $TOKCOMP_DATA --keep-rates 0.5,0.7 \\
        --pairs dpcknn:topk,kmedoids:topk,tome:topk,dpcknn:tome --out runs/study_paired.csv

Prints one markdown table; --out also writes every row as CSV.
"""
import argparse
import csv
from pathlib import Path
from typing import Dict, List, Tuple

import timm
import torch

import timm_tokcomp
from timm_tokcomp.measure.stats import mcnemar_exact_p
from timm_tokcomp.files.data import open_dataset
from timm_tokcomp.methods import parse_method_tag
from timm_tokcomp.models.build import build_base_model
from timm_tokcomp.training.finetune import predict

MODEL = "deit_tiny_patch16_224"
SETS = ("imagenet-val-1300", "nips17-1000")


def correct_per_image(data: Path, tags: List[str], batch_size: int) -> Dict[str, Dict[str, torch.Tensor]]:
    """{set: {tag: (images,) bool, top-1 right}} for every set of SETS and every method tag ("none": plain)."""
    model = build_base_model(MODEL, str(data / f"{MODEL}.safetensors"), pretrained=False, device="cpu")
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    result = {}
    for name in SETS:
        loader = torch.utils.data.DataLoader(open_dataset(data / name, transform), batch_size=batch_size)
        result[name] = {}
        for tag in tags:
            timm_tokcomp.remove(model)
            if tag != "none":
                method, params = parse_method_tag(tag)
                timm_tokcomp.apply(model, method, **params)
            with torch.inference_mode():
                labels, preds = predict(model, loader, "cpu", True, f"{name} {tag}")
            result[name][tag] = preds == labels
    return result


def paired_rows(correct: Dict[str, Dict[str, torch.Tensor]], pairs: List[Tuple[str, str]],
                keep_rates: List[float]) -> List[Dict]:
    """One row per (keep rate, pair, set or 'pooled'): top-1 of both, images gained / lost by the first, p."""
    rows = []
    for keep in keep_rates:
        for first, second in pairs:
            a, b = (f"{m}_k{round(keep * 100)}" for m in (first, second))
            for name in (*SETS, "pooled"):
                sets = SETS if name == "pooled" else (name,)
                right_a = torch.cat([correct[s][a] for s in sets])
                right_b = torch.cat([correct[s][b] for s in sets])
                gained, lost = int((right_a & ~right_b).sum()), int((~right_a & right_b).sum())
                rows.append({"keep_rate": keep, "first": first, "second": second, "set": name,
                             "images": len(right_a), "top1_first": 100 * right_a.float().mean().item(),
                             "top1_second": 100 * right_b.float().mean().item(), "gained": gained, "lost": lost,
                             "p": mcnemar_exact_p(gained, lost)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="TOKCOMP_DATA: the weights and both labelled sets")
    parser.add_argument("--keep-rates", default="0.5,0.7")
    parser.add_argument("--pairs", default="dpcknn:topk,kmedoids:topk,tome:topk,dpcknn:tome")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--out", type=Path, help="CSV of every row")
    args = parser.parse_args()
    keep_rates = [float(k) for k in args.keep_rates.split(",")]
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",")]
    tags = sorted({f"{m}_k{round(k * 100)}" for k in keep_rates for pair in pairs for m in pair})
    rows = paired_rows(correct_per_image(args.data, tags, args.batch_size), pairs, keep_rates)
    print("| keep rate | first vs second | set | top-1 first / second | gained / lost | McNemar p |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['keep_rate']} | {r['first']} vs {r['second']} | {r['set']} | {r['top1_first']:.2f} / "
              f"{r['top1_second']:.2f} | +{r['gained']} / -{r['lost']} | {r['p']:.2g} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
