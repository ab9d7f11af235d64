"""Choose and judge ToCom compensators for DeiT-Tiny: a label-free choice on held-out training photos,
then the verdict on the 2,300 labelled ImageNet images (imagenet-val-1300 + nips17-1000), per set and pooled.

1. Selection (written to OUT/selection.md before any labelled image is read): on the images a run held
   out (`--select-on` folder, `--holdout` of them picked as `tokcomp train-tocom --holdout-pick spread`
   picks them; a --holdout of at least the folder's size takes every image, for compensators all trained on
   other images), the distillation loss KL(r = 0 || r = t + ToCom) for t in 4, 8, 12, 16, relative to ToMe
   alone's, and the agreement with the r = 0 model. The lowest mean relative loss is the choice (every
   target counts alike; the plain mean would be decided by r = 16, whose losses are the largest).
2. Evaluation: for r in 4, 8, 12, 16, ToMe alone and ToMe + each compensator (source r = 0): agreement
   with the r = 0 model and top-1, with images gained / lost against ToMe alone and exact McNemar p,
   per set and pooled; and every pair of compensators against each other (pooled agreement).
   Predictions are cached in OUT/predictions/, so a rerun only computes what is missing.

    python examples/tocom_imagenet_eval.py --data $TOKCOMP_DATA --out runs/tocom_eval \\
        --adapter old=hub_cards/deit_tiny_patch16_224-tocom --adapter new=runs/tocom_photos \\
        --adapter new075=runs/tocom_photos@0.075 \\
        --select-on $TOKCOMP_DATA/photos-3000 --holdout 300
"""
import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import timm
import torch
from tqdm import tqdm

import timm_tokcomp
from timm_tokcomp.measure.stats import mcnemar_exact_p
from timm_tokcomp.files.data import open_dataset, open_images
from timm_tokcomp.tocom import attach, detach, load, set_compression
from timm_tokcomp.training.mosaic import heldout_indices
from timm_tokcomp.training.engine import distill_loss

MODEL = "deit_tiny_patch16_224"
SETS = ("imagenet-val-1300", "nips17-1000")
TARGETS = (4, 8, 12, 16)


def build_model(data: Path) -> torch.nn.Module:
    model = timm.create_model(MODEL, checkpoint_path=str(data / f"{MODEL}.safetensors")).eval()
    return timm_tokcomp.apply(model, "tome", r=0)


def loader_for(dataset, batch_size: int = 100) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=2)


@torch.inference_mode()
def logits_at(model: torch.nn.Module, loader, r: int, compensator=None, desc: str = "") -> torch.Tensor:
    """(images, classes) logits at ToMe r, with the compensator for 0 -> r when one is given: a
    (Compensator, scale) pair."""
    if compensator is None:
        timm_tokcomp.set_params(model, r=r)
    else:
        attach(model, compensator[0], source_r=0, scale=compensator[1])
        set_compression(model, r=r)
    try:
        return torch.cat([model(x) for x, _ in tqdm(loader, desc=desc, leave=False, file=sys.stderr)])
    finally:
        if compensator is not None:
            detach(model)


def select(model, adapters: Dict[str, object], folder: Path, holdout: int) -> Tuple[str, str]:
    """(chosen adapter name, markdown table) from the label-free rule on the held-out images."""
    images = open_images(folder, timm.data.create_transform(**timm.data.resolve_model_data_config(model)))
    loader = loader_for(torch.utils.data.Subset(images, heldout_indices(len(images), min(holdout, len(images)),
                                                                        "spread")))
    teacher = logits_at(model, loader, 0, desc="held-out r = 0")
    rows, relative, plain = [], {}, None
    for name, compensator in {"ToMe alone": None, **adapters}.items():
        losses, agreements = [], []
        for r in TARGETS:
            student = logits_at(model, loader, r, compensator, f"held-out {name} r = {r}")
            losses.append(distill_loss(student, teacher, 1.0, True).item())
            agreements.append(100 * (student.argmax(-1) == teacher.argmax(-1)).float().mean().item())
        plain = plain or losses
        relative[name] = sum(l / p for l, p in zip(losses, plain)) / len(losses)
        rows.append(f"| {name} | " + " | ".join(f"{l:.4f}" for l in losses) + f" | {relative[name]:.3f} | "
                    + " | ".join(f"{a:.2f}" for a in agreements) + " |")
    chosen = min(adapters, key=relative.get)
    head = ("| compensator | " + " | ".join(f"KL r={r}" for r in TARGETS) + " | mean KL / ToMe's | "
            + " | ".join(f"agree r={r}" for r in TARGETS) + " |")
    table = "\n".join([head, "|" + " --- |" * (2 + 2 * len(TARGETS)), *rows])
    which = (f"all {len(images)} images of {folder.name} (for compensators trained on other images)"
             if holdout >= len(images) else f"{len(loader.dataset)} held-out images of {folder.name} (never trained "
             f"on by a run with --holdout {holdout} --holdout-pick spread)")
    note = f"{which}, source r = 0. Chosen: **{chosen}** (lowest mean relative KL)."
    return chosen, note + "\n\n" + table


def predictions(model, data: Path, adapters: Dict[str, object], cache: Path) -> Dict[str, Dict[str, torch.Tensor]]:
    """Per set: labels and predicted classes of every row ('r0', 'tome_r<t>', '<adapter>_r<t>')."""
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model))
    cache.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in SETS:
        dataset = open_dataset(data / name, transform)
        loader = loader_for(dataset)
        per = {"labels": torch.tensor([label for _, label in dataset.samples])}
        rows = [("r0", 0, None)] + [(f"tome_r{r}", r, None) for r in TARGETS] + \
               [(f"{a}_r{r}", r, a) for a in adapters for r in TARGETS]
        for row, r, adapter in rows:
            path = cache / f"{name}__{row}.pt"
            if not path.is_file():
                logits = logits_at(model, loader, r, adapters.get(adapter), f"{name} {row}")
                torch.save(logits.argmax(-1), path)
            per[row] = torch.load(path)
        out[name] = per
    return out


def _pair(new: torch.Tensor, old: torch.Tensor) -> str:
    gained, lost = int((new & ~old).sum()), int((old & ~new).sum())
    return f"+{gained} / -{lost} ({mcnemar_exact_p(gained, lost):.2g})"


def report(preds: Dict[str, Dict[str, torch.Tensor]], adapters: List[str]) -> Tuple[str, Dict]:
    pooled = {k: torch.cat([preds[s][k] for s in SETS]) for k in preds[SETS[0]]}
    lines, figures = [], {}
    for name, per in [*preds.items(), (f"pooled ({' + '.join(SETS)})", pooled)]:
        n = len(per["labels"])
        base_top1 = 100 * (per["r0"] == per["labels"]).float().mean().item()
        lines += [f"### {name}: {n} images, r = 0 top-1 {base_top1:.2f}", "",
                  "| r | row | agreement | top-1 | agreement vs ToMe: gained / lost (p) | top-1 vs ToMe: gained / lost (p) |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in TARGETS:
            tome = f"tome_r{r}"
            for row in [tome, *(f"{a}_r{r}" for a in adapters)]:
                agree, correct = per[row] == per["r0"], per[row] == per["labels"]
                figures[f"{name}|{row}"] = {"agreement": 100 * agree.float().mean().item(),
                                            "top1": 100 * correct.float().mean().item()}
                paired = ("", "") if row == tome else (_pair(agree, per[tome] == per["r0"]),
                                                       _pair(correct, per[tome] == per["labels"]))
                label = "ToMe" if row == tome else f"ToMe + {row.rsplit('_r', 1)[0]}"
                lines.append(f"| {r} | {label} | {figures[f'{name}|{row}']['agreement']:.2f} | "
                             f"{figures[f'{name}|{row}']['top1']:.2f} | {paired[0]} | {paired[1]} |")
        lines.append("")
    if len(adapters) > 1:
        lines += ["### compensators against each other, pooled agreement", "",
                  "| r | first | second | first vs second: gained / lost (p) |", "| --- | --- | --- | --- |"]
        for r in TARGETS:
            for a, b in itertools.combinations(adapters, 2):
                lines.append(f"| {r} | {a} | {b} | {_pair(pooled[f'{a}_r{r}'] == pooled['r0'], pooled[f'{b}_r{r}'] == pooled['r0'])} |")
    return "\n".join(lines) + "\n", figures


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="TOKCOMP_DATA folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--adapter", action="append", required=True, metavar="NAME=FOLDER[@SCALE]",
                        help="a compensator to judge, at its own scale or SCALE (repeatable)")
    parser.add_argument("--select-on", type=Path, help="folder whose held-out images choose among the adapters")
    parser.add_argument("--holdout", type=int, default=300, help="held-out images of --select-on (default %(default)s)")
    args = parser.parse_args(argv)
    adapters = {}
    for spec in args.adapter:
        name, sep, folder = spec.partition("=")
        if not sep or not name or "_r" in name:
            raise SystemExit(f"--adapter must be NAME=FOLDER[@SCALE] with a NAME free of '_r', got {spec!r}")
        folder, _, scale = folder.partition("@")
        compensator = load(folder)[0]
        adapters[name] = (compensator, float(scale) if scale else compensator.scale)
    torch.set_grad_enabled(False)
    model = build_model(args.data)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.select_on is not None:
        chosen, text = select(model, adapters, args.select_on, args.holdout)
        (args.out / "selection.md").write_text(text + "\n")
        print(text, flush=True)
    text, figures = report(predictions(model, args.data, adapters, args.out / "predictions"), list(adapters))
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps(figures, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
