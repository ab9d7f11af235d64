"""FPET beside PYRA on the same downstream task and recipe as examples/pyra_downstream.py: DeiT-Tiny LoRA-fine-tuned
on the VTAB-1k-style Caltech-101 split (15 epochs, lr 3e-3, batch 32, crops and flips), with FPET (half the patches
merged in block 6 on a checkerboard, the matching metric refined by its learned 1-bit adapter) and with FPET's merge
alone (`fpet_norefine`), at the same MACs. Each run is resumable; then a table and the two arms image by image on
the test split (exact McNemar).

    python examples/fpet_downstream.py --data $TOKCOMP_DATA --out runs/pyra_caltech --epochs 15 --lr 3e-3
"""
import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from pyra_downstream import correct_flags, run_arms
from timm_tokcomp.measure.stats import mcnemar_exact_p
from timm_tokcomp.training.folder import FINETUNE_CONFIG

ARMS = [("g_fpet", "fpet", {}, (0,)), ("h_fpet_norefine", "fpet_norefine", {}, (0,))]


def report(out: Path) -> str:
    lines = ["| arm | method | seed | test top-1 | GMACs | train min |", "| --- | --- | --- | --- | --- | --- |"]
    for arm, method, _, seeds in ARMS:
        for seed in seeds:
            res = json.loads((out / f"{arm}_seed{seed}" / FINETUNE_CONFIG).read_text())["results"]
            lines.append(f"| {arm} | {method} | {seed} | {res['top1']:.2f} | {res['gmacs']:.4f} | "
                         f"{res['train_seconds'] / 60:.1f} |")
    refined, plain = correct_flags(out / "g_fpet_seed0"), correct_flags(out / "h_fpet_norefine_seed0")
    gained, lost = int((refined & ~plain).sum()), int((plain & ~refined).sum())
    lines += ["", f"FPET against its merge alone, image by image: {gained} test images right only with the adapter, "
                  f"{lost} only without it, exact McNemar p = {mcnemar_exact_p(gained, lost):.3g}."]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="TOKCOMP_DATA folder (caltech101-vtab, weights)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the runs and fpet_results.md")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--num-workers", type=int, default=2)
    args = parser.parse_args(argv)
    run_arms(args.data, args.out, args.epochs, args.lr, args.num_workers, 1, ARMS)
    table = report(args.out)
    (args.out / "fpet_results.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
