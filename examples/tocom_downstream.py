"""ToCom's real use (the paper's Table 2 setting): plug the ImageNet-trained compensator into a model fine-tuned
on another task, at a compression degree it was not tuned for, without re-tuning.

DeiT-Tiny fine-tuned with LoRA on the Caltech-101 VTAB-1k-style split at source r = 0 (no reduction) and at
source r = 16 (ToMe), both with `tokcomp finetune`'s recipe; each evaluated on the test split at target
r in {0, 4, 8, 12, 16}, without and with the shipped compensator composed for source -> target. Paired
counts and exact McNemar p per cell; a table and a plot.

    python examples/tocom_downstream.py --data $TOKCOMP_DATA --out runs/tocom_caltech \\
        --source0 runs/pyra_caltech/a_lora_seed0        # an existing r = 0 fine-tune (trained here if absent)
"""
import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

import timm
import torch

import timm_tokcomp
from timm_tokcomp.measure.stats import mcnemar_exact_p
from timm_tokcomp.files.data import open_dataset
from timm_tokcomp.tocom import attach, detach, load, set_compression
from timm_tokcomp.training import FinetuneConfig, finetune, load_finetuned
from timm_tokcomp.training.finetune import predict
from timm_tokcomp.training.folder import FINETUNE_CONFIG

MODEL = "deit_tiny_patch16_224"
SHIPPED = Path(__file__).resolve().parents[1] / "hub_cards" / "deit_tiny_patch16_224-tocom"
TARGETS = (0, 4, 8, 12, 16)


def _finished(folder: Path) -> bool:
    path = folder / FINETUNE_CONFIG
    return path.is_file() and "results" in json.loads(path.read_text())


def ensure_finetuned(folder: Path, method: str, data: Path, epochs: int, lr: float) -> None:
    if _finished(folder):
        return
    print(f"== fine-tuning {folder}", file=sys.stderr, flush=True)
    finetune(MODEL, str(data / "caltech101-vtab/train/labels.csv"), str(folder),
             str(data / "caltech101-vtab/test/labels.csv"), FinetuneConfig(method=method, epochs=epochs, lr=lr),
             checkpoint=str(data / "deit_tiny_patch16_224.safetensors"), resume=folder.exists())


def grid(folder: Path, source_r: int, data: Path, tocom: str) -> Dict[int, Dict[str, torch.Tensor]]:
    """Per target r: correct flags (test images) without and with the compensator for source_r -> r."""
    model = load_finetuned(str(folder), checkpoint=str(data / "deit_tiny_patch16_224.safetensors"))
    test = open_dataset(data / "caltech101-vtab/test/labels.csv",
                        timm.data.create_transform(**timm.data.resolve_model_data_config(model)))
    loader = torch.utils.data.DataLoader(test, batch_size=64, num_workers=2)
    compensator, _ = load(tocom)
    out: Dict[int, Dict[str, torch.Tensor]] = {}
    for r in TARGETS:
        if timm_tokcomp.is_reduced(model):
            timm_tokcomp.set_params(model, r=r)
        else:
            timm_tokcomp.apply(model, "tome", r=r)
        y, plain = predict(model, loader, "cpu", True, f"source {source_r} -> {r}")
        attach(model, compensator, source_r=source_r)
        set_compression(model, r=r)
        _, compensated = predict(model, loader, "cpu", True, f"source {source_r} -> {r} + ToCom")
        detach(model)
        out[r] = {"without": plain == y, "with": compensated == y}
    return out


def plot(results: Dict[int, Dict[int, Dict[str, torch.Tensor]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=90)
    for source, colour in zip(results, ("tab:blue", "tab:orange")):
        for kind, style in (("without", "--"), ("with", "-")):
            ax.plot(TARGETS, [100 * results[source][r][kind].float().mean().item() for r in TARGETS], style,
                    color=colour, marker="o", label=f"source r = {source}, {kind} ToCom")
    ax.set_xlabel("target r (ToMe)")
    ax.set_ylabel("Caltech-101 test top-1 (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(path, bbox_inches="tight")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--source0", type=Path, help="an r = 0 fine-tune to reuse (default: OUT/source_r0)")
    parser.add_argument("--tocom", default=str(SHIPPED), help="compensator folder or Hub repo (default: the shipped one)")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    sources = {0: args.source0 or args.out / "source_r0", 16: args.out / "source_r16"}
    for r, folder in sorted(sources.items(), reverse=True):
        if r == 0 and args.source0 is not None:
            if not _finished(folder):
                raise SystemExit(f"--source0 {folder} is not a finished fine-tune (no results in {FINETUNE_CONFIG})")
            continue
        ensure_finetuned(folder, "none" if r == 0 else f"tome_r{r}", args.data, args.epochs, args.lr)
    results = {r: grid(folder, r, args.data, args.tocom) for r, folder in sources.items()}
    lines = ["| source r | target r | top-1 without ToCom | top-1 with ToCom | gained | lost | McNemar p |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for source, per_target in results.items():
        for r, flags in per_target.items():
            gained = int((flags["with"] & ~flags["without"]).sum())
            lost = int((flags["without"] & ~flags["with"]).sum())
            lines.append(f"| {source} | {r} | {100 * flags['without'].float().mean():.2f} | "
                         f"{100 * flags['with'].float().mean():.2f} | {gained} | {lost} | {mcnemar_exact_p(gained, lost):.3g} |")
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(table + "\n")
    plot(results, args.out / "grid.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
