"""Methods against reference methods image by image, on a labelled folder: GMACs per image (counted from the run),
top-1, agreement with the plain model, and against each reference the images gained and lost with the exact
McNemar p (timm_tokcomp.measure.agreement). The study's protocol for a new method at matched GMACs.

    python scripts/paired_methods.py --data $TOKCOMP_DATA/imagenet-val-1300 \\
        --checkpoint $TOKCOMP_DATA/deit_tiny_patch16_224.safetensors --reference tome_k70,dpcknn_k70 \\
        --methods tofu_k70,pitome_k70,dct_k70,atc_k70

A --methods entry may also be a folder `tokcomp finetune` wrote (a learned method's parameters, e.g. DiffRate's
searched rates): the model it saved, on the same weights.
"""
import argparse
import copy
import sys
from pathlib import Path

import timm
import torch
from tqdm import tqdm

import timm_tokcomp
from timm_tokcomp.files.data import open_images
from timm_tokcomp.measure.agreement import compare, predict
from timm_tokcomp.deployment.specs import method_spec
from timm_tokcomp.models.build import build_base_model
from timm_tokcomp.training import load_finetuned
from timm_tokcomp.training.folder import FINETUNE_CONFIG


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deit_tiny_patch16_224")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data", required=True, help="a labelled folder (labels.csv or class folders)")
    parser.add_argument("--reference", default="tome_r8", help="comma list of the method tags the others are paired "
                                                              "against")
    parser.add_argument("--methods", required=True, help="comma list of method tags or `tokcomp finetune` folders")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    plain = build_base_model(args.model, args.checkpoint, False, "cpu")
    dataset = open_images(args.data, timm.data.create_transform(**timm.data.resolve_model_data_config(plain)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, num_workers=2)
    batches, labels = [], []
    for x, y in tqdm(loader, desc="load", file=sys.stderr):
        batches.append(x)
        labels.append(y)
    y = torch.cat(labels)
    references = [m.strip() for m in args.reference.split(",") if m.strip()]
    names = references + [m.strip() for m in args.methods.split(",") if m.strip() and m.strip() not in references]
    preds, gmacs = {}, {}
    for name in ["none"] + names:
        if name == "none":
            model = plain
        elif Path(name, FINETUNE_CONFIG).is_file():
            model = load_finetuned(name, checkpoint=args.checkpoint)
        else:
            method, params = method_spec(name)
            model = timm_tokcomp.apply(copy.deepcopy(plain), method, **params)
        classes, macs = predict(model, tqdm(batches, desc=name, file=sys.stderr), count_macs=True)
        preds[name] = classes
        gmacs[name] = sum(m * len(x) for m, x in zip(macs, batches)) / len(y) / 1e9
    print(f"{args.model} on {args.data} ({len(y)} images); paired against {', '.join(references)}")
    print("| method | GMACs | top-1 % | agreement % | " + " | ".join(f"vs {r}: gained / lost (McNemar p)" for r in references)
          + " |")
    print("| --- " * (4 + len(references)) + "|")
    for name in ["none"] + names:
        own = compare(preds[name], preds["none"], y)
        cells = []
        for ref in references:
            paired = compare(preds[name], preds[ref], y)
            cells.append("-" if name in ("none", ref) else f"+{paired.gained} / -{paired.lost} ({paired.top1_p:.2g})")
        print(f"| {name} | {gmacs[name]:.4f} | {own.top1:.2f} | {own.agreement:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
