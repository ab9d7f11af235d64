"""PYRA on a real downstream task: DeiT-Tiny fine-tuned with LoRA on a VTAB-1k-style Caltech-101 split,
without reduction, with ToMe and with PYRA at the paper's "low" and "high" schedules, and the r-agnostic
('pooled') PYRA trained at "high" and run at "low". Every arm uses the same recipe; each run is resumable
(re-run the script after an interruption). Then a results table, with an exact McNemar test (image by image)
between ToMe-high and PYRA-high per seed, and their mean gain over the seeds.

    python examples/pyra_downstream.py --data $TOKCOMP_DATA --out runs/pyra_caltech --epochs 15 --lr 3e-3
    # --high-seeds 4: arms (c) and (e) with seeds 0-3 (the others keep seed 0)
"""
import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

import timm
import torch

import timm_tokcomp
from timm_tokcomp.measure.stats import mcnemar_exact_p
from timm_tokcomp.files.data import open_dataset
from timm_tokcomp.measure.counting import count_macs
from timm_tokcomp.methods.schedules import NAMED_SCHEDULES
from timm_tokcomp.training import FinetuneConfig, finetune, load_finetuned
from timm_tokcomp.training.finetune import predict
from timm_tokcomp.training.folder import FINETUNE_CONFIG

MODEL = "deit_tiny_patch16_224"
# (arm, method tag, method arguments, seeds); None: the --high-seeds seeds (the two arms compared per seed)
ARMS = [
    ("a_lora", "none", {}, (0,)),
    ("b_tome_low", "tome_low", {}, (0,)),
    ("c_tome_high", "tome_high", {}, None),
    ("d_pyra_low", "pyra_low", {}, (0,)),
    ("e_pyra_high", "pyra_high", {}, None),
    ("f_pyra_pooled_high", "pyra_high", {"form": "pooled"}, (0,)),
]


def arm_seeds(seeds: Optional[tuple], high_seeds: int) -> tuple:
    return tuple(range(high_seeds)) if seeds is None else seeds


def run_arms(data: Path, out: Path, epochs: int, lr: float, workers: int, high_seeds: int, arms=ARMS) -> None:
    for arm, method, args, seeds in arms:
        for seed in arm_seeds(seeds, high_seeds):
            folder = out / f"{arm}_seed{seed}"
            if (folder / FINETUNE_CONFIG).is_file() and "results" in json.loads((folder / FINETUNE_CONFIG).read_text()):
                continue
            print(f"== {folder.name}", file=sys.stderr, flush=True)
            config = FinetuneConfig(method=method, method_args=args, epochs=epochs, lr=lr, seed=seed)
            finetune(MODEL, str(data / "caltech101-vtab/train/labels.csv"), str(folder),
                     str(data / "caltech101-vtab/test/labels.csv"), config,
                     checkpoint=str(data / "deit_tiny_patch16_224.safetensors"), resume=folder.exists(),
                     num_workers=workers)


def correct_flags(folder: Path) -> torch.Tensor:
    with open(folder / "training" / "predictions.csv") as f:
        return torch.tensor([row["label"] == row["prediction"] for row in csv.DictReader(f)])


def evaluate_at(folder: Path, data: Path, r: List[int]) -> Dict[str, float]:
    """Top-1 and GMACs of a saved pooled-PYRA model run at schedule r on the test split."""
    model = load_finetuned(str(folder), checkpoint=str(data / "deit_tiny_patch16_224.safetensors"))
    timm_tokcomp.set_params(model, r=r)
    test = open_dataset(data / "caltech101-vtab/test/labels.csv",
                        timm.data.create_transform(**timm.data.resolve_model_data_config(model)))
    y, pred = predict(model, torch.utils.data.DataLoader(test, batch_size=64), "cpu", True, "evaluate")
    x = torch.stack([test[i][0] for i in range(16)])
    return {"top1": 100.0 * (pred == y).float().mean().item(), "gmacs": count_macs(model, x) / len(x) / 1e9,
            "correct": (pred == y)}


def report(data: Path, out: Path, high_seeds: int) -> str:
    lines = ["| arm | method (training schedule -> run schedule) | seed | test top-1 | GMACs | train min |",
             "| --- | --- | --- | --- | --- | --- |"]
    results = {}
    for arm, method, args, seeds in ARMS:
        for seed in arm_seeds(seeds, high_seeds):
            folder = out / f"{arm}_seed{seed}"
            res = json.loads((folder / FINETUNE_CONFIG).read_text())["results"]
            results[(arm, seed)] = res
            shown = method + (" (pooled)" if args else "")
            lines.append(f"| {arm} | {shown} | {seed} | {res['top1']:.2f} | {res['gmacs']:.4f} | "
                         f"{res['train_seconds'] / 60:.1f} |")
    pooled = evaluate_at(out / "f_pyra_pooled_high_seed0", data, NAMED_SCHEDULES["low"])
    lines.append(f"| f_pyra_pooled_high | pyra (pooled), trained high -> run low | 0 | {pooled['top1']:.2f} | "
                 f"{pooled['gmacs']:.4f} | |")
    lines += ["", "Paired (image by image) on the test split, PYRA-high against ToMe-high:", "",
              "| seed | ToMe-high right only | PYRA-high right only | exact McNemar p |", "| --- | --- | --- | --- |"]
    for seed in range(high_seeds):
        tome, pyra = correct_flags(out / f"c_tome_high_seed{seed}"), correct_flags(out / f"e_pyra_high_seed{seed}")
        gained, lost = int((pyra & ~tome).sum()), int((tome & ~pyra).sum())
        lines.append(f"| {seed} | {lost} | {gained} | {mcnemar_exact_p(gained, lost):.3g} |")
    mean = {arm: sum(results[(arm, s)]["top1"] for s in range(high_seeds)) / high_seeds
            for arm in ("c_tome_high", "e_pyra_high")}
    lines += ["", f"Mean over seeds 0-{high_seeds - 1}: PYRA-high {mean['e_pyra_high']:.2f}, ToMe-high "
                  f"{mean['c_tome_high']:.2f}, gain {mean['e_pyra_high'] - mean['c_tome_high']:+.2f} points."]
    d = correct_flags(out / "d_pyra_low_seed0")
    gained, lost = int((pooled["correct"] & ~d).sum()), int((d & ~pooled["correct"]).sum())
    lines += ["", f"Pooled PYRA trained at high and run at low against PYRA trained at low (paper form): "
                  f"{gained} images right only with the pooled one, {lost} only with the paper form, "
                  f"McNemar p = {mcnemar_exact_p(gained, lost):.3g}."]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="TOKCOMP_DATA folder (caltech101-vtab, weights)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the runs and results.md")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--high-seeds", type=int, default=2, help="seeds 0..N-1 for ToMe-high and PYRA-high (>= 1)")
    parser.add_argument("--report-only", action="store_true", help="only build the table from finished runs")
    args = parser.parse_args(argv)
    if args.high_seeds < 1:
        parser.error(f"--high-seeds must be >= 1, got {args.high_seeds}")
    if not args.report_only:
        run_arms(args.data, args.out, args.epochs, args.lr, args.num_workers, args.high_seeds)
    table = report(args.data, args.out, args.high_seeds)
    (args.out / "results.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
