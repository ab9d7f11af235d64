"""The study's learned methods on real DeiT-Tiny, trained without labels and judged against their own untrained
start ("Which Tokens to Use?" protocol, keep rate 0.7).

Each method is fine-tuned by `tokcomp finetune --distill` on `photos-3000` (3,000 unlabelled in-domain ImageNet
train photos): LoRA on qkv plus the method's parameters learn the unreduced model's outputs. 300 of the photos
(evenly spaced through the sorted folder) are held out for the per-epoch evaluation; the labelled sets play no
part in training or in any choice. Then the untrained start (the same seed, so the same initial parameters) and the trained model
are evaluated on `imagenet-val-1300` and `nips17-1000`: top-1 and agreement with the plain model, with images
gained / lost and exact McNemar p, per set and pooled.

    python examples/learned_methods.py --data $TOKCOMP_DATA --out runs/learned --methods dynamicvit_k70 \\
        --epochs 10 --lr 5e-3 --lora-rank 0                # resumable: run it again to continue
"""
import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional

import timm
import torch

import timm_tokcomp
from timm_tokcomp.measure.stats import mcnemar_exact_p
from timm_tokcomp.models.build import build_base_model
from timm_tokcomp.files.data import open_dataset, open_images
from timm_tokcomp.measure.counting import count_macs
from timm_tokcomp.methods import parse_method_tag
from timm_tokcomp.training.mosaic import heldout_indices
from timm_tokcomp.training import FinetuneConfig, finetune, load_finetuned
from timm_tokcomp.training.finetune import predict
from timm_tokcomp.training.folder import FINETUNE_CONFIG

MODEL = "deit_tiny_patch16_224"
SETS = ("imagenet-val-1300", "nips17-1000")


def split_photos(photos: Path, out: Path, holdout: int) -> Dict[str, Path]:
    """OUT/photos/{train,heldout}: hard links to the photos (copies across file systems; a symbolic link leading
    out of --data is refused), `holdout` of them (evenly spaced) held out."""
    files = sorted(p for p in photos.iterdir() if p.suffix.lower() in (".jpeg", ".jpg", ".png"))
    held = set(heldout_indices(len(files), holdout, "spread"))
    folders = {"train": out / "photos" / "train", "heldout": out / "photos" / "heldout"}
    for name, folder in folders.items():
        folder.mkdir(parents=True, exist_ok=True)
        for i, path in enumerate(files):
            link = folder / path.name
            if (i in held) == (name == "heldout") and not link.exists():
                try:
                    os.link(path.resolve(), link)
                except OSError:  # another file system, or no hard links there
                    shutil.copyfile(path, link)
    return folders


def untrained_start(tag: str, checkpoint: str, seed: int) -> torch.nn.Module:
    """The model finetune starts from: the same seed before building, so the same initial method parameters
    (LoRA's B starts at zero, so LoRA adds nothing yet)."""
    torch.manual_seed(seed)
    model = build_base_model(MODEL, checkpoint, False, "cpu")
    name, params = parse_method_tag(tag)
    return timm_tokcomp.apply(model, name, **params).eval()


def predictions(model: torch.nn.Module, data: Path, desc: str) -> Dict[str, torch.Tensor]:
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model))
    out = {}
    for name in SETS:
        loader = torch.utils.data.DataLoader(open_dataset(data / name, transform), batch_size=100, num_workers=2)
        out[name] = predict(model, loader, "cpu", True, f"{desc} on {name}")
    return out


def paired(new: torch.Tensor, old: torch.Tensor) -> str:
    gained, lost = int((new & ~old).sum()), int((old & ~new).sum())
    return f"+{gained} / -{lost} (p = {mcnemar_exact_p(gained, lost):.2g})"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--methods", default="patchmerger_k70", help="comma-separated method tags")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lora-rank", type=int, default=8, help="0: only the method's parameters train")
    parser.add_argument("--holdout", type=int, default=300, help="photos held out for the per-epoch evaluation")
    args = parser.parse_args(argv)
    checkpoint = str(args.data / f"{MODEL}.safetensors")
    folders = split_photos(args.data / "photos-3000", args.out, args.holdout)
    cache = args.out / "predictions"
    cache.mkdir(parents=True, exist_ok=True)
    plain_path = cache / "plain.pt"
    if not plain_path.is_file():
        torch.save(predictions(build_base_model(MODEL, checkpoint, False, "cpu").eval(), args.data, "plain"), plain_path)
    plain = torch.load(plain_path)
    lines = ["| method | model | GMACs | " + " | ".join(f"{s} top-1 | {s} agreement" for s in SETS) +
             " | pooled top-1 | pooled agreement |", "|" + " --- |" * (3 + 2 * len(SETS) + 2)]
    notes = []
    for tag in [t.strip() for t in args.methods.split(",") if t.strip()]:
        run = args.out / tag
        done = (run / FINETUNE_CONFIG).is_file() and "results" in json.loads((run / FINETUNE_CONFIG).read_text())
        if not done:
            config = FinetuneConfig(method=tag, epochs=args.epochs, lr=args.lr, seed=args.seed, distill=True,
                                    batch_size=args.batch_size, warmup_epochs=min(1, args.epochs - 1),
                                    lora_rank=args.lora_rank)
            finetune(MODEL, str(folders["train"]), str(run), str(folders["heldout"]), config, checkpoint=checkpoint,
                     resume=run.exists())
        flags = {}
        for kind, build in (("untrained", lambda: untrained_start(tag, checkpoint, args.seed)),
                            ("trained", lambda: load_finetuned(str(run), checkpoint=checkpoint))):
            path = cache / f"{tag}__{kind}.pt"
            model = build()
            if not path.is_file():
                torch.save(predictions(model, args.data, f"{tag} {kind}"), path)
            got = torch.load(path)
            photos = open_images(folders["heldout"], timm.data.create_transform(
                **timm.data.resolve_model_data_config(model)))
            x = torch.stack([photos[i][0] for i in range(min(8, len(photos)))])
            gmacs = count_macs(model, x) / len(x) / 1e9
            flags[kind] = {s: (got[s][1] == got[s][0], got[s][1] == plain[s][1]) for s in SETS}
            pooled = [torch.cat([flags[kind][s][j] for s in SETS]) for j in (0, 1)]
            flags[kind]["pooled"] = pooled
            cells = [f"{100 * flags[kind][s][j].float().mean():.2f}" for s in SETS for j in (0, 1)]
            cells += [f"{100 * pooled[j].float().mean():.2f}" for j in (0, 1)]
            lines.append(f"| `{tag}` | {kind} | {gmacs:.4f} | " + " | ".join(cells) + " |")
        for s in (*SETS, "pooled"):
            new, old = flags["trained"][s], flags["untrained"][s]
            notes.append(f"- `{tag}`, {s}: trained vs untrained, top-1 {paired(new[0], old[0])}, "
                         f"agreement {paired(new[1], old[1])}")
    text = "\n".join(lines + [""] + notes) + "\n"
    (args.out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
