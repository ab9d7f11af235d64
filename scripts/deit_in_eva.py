"""DeiT-Tiny's real weights run through the Eva path (timm's Eva class with an absolute position embedding, no
rope): top-1 and agreement with the plain model of ToMe r8 / r16 on imagenet-val-1300, beside the same figures of
the VisionTransformer path, image by image (paired counts). Every part of the Eva adapter except rope, with real
weights; the data README's reference: r8 81.15 % / 96.54 %, r16 79.00 % / 90.23 %.

    TOKCOMP_DATA=path/to/data python scripts/deit_in_eva.py"""
import csv
import os
import sys
from pathlib import Path

import timm
import torch
from PIL import Image
from tqdm import tqdm

import timm_tokcomp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import eva_from_deit  # noqa: E402


def main() -> None:
    data = Path(os.environ.get("TOKCOMP_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    deit = timm.create_model("deit_tiny_patch16_224",
                             checkpoint_path=str(data / "deit_tiny_patch16_224.safetensors")).eval()
    eva = eva_from_deit(deit)
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(deit))
    folder = data / "imagenet-val-1300"
    with open(folder / "labels.csv") as f:
        rows = list(csv.DictReader(f))
    labels = torch.tensor([int(r["label"]) for r in rows])
    preds = {}
    torch.set_grad_enabled(False)
    for r in (0, 8, 16):
        for name, model in (("vit", deit), ("eva", eva)):
            timm_tokcomp.apply(model, "tome", r=r)
            out = []
            for i in tqdm(range(0, len(rows), 64), desc=f"{name} r{r}"):
                batch = torch.stack([transform(Image.open(folder / "images" / row["file"]).convert("RGB"))
                                     for row in rows[i:i + 64]])
                out.append(model(batch).argmax(-1))
            preds[name, r] = torch.cat(out)
    for r in (8, 16):
        for name in ("vit", "eva"):
            top1 = (preds[name, r] == labels).float().mean().item() * 100
            agree = (preds[name, r] == preds[name, 0]).float().mean().item() * 100
            print(f"{name} ToMe r{r}: top-1 {top1:.2f} %, agreement {agree:.2f} % ({len(rows)} images)")
        differ = (preds["vit", r] != preds["eva", r]).sum().item()
        print(f"r{r}: images whose prediction differs between the two paths: {differ}")
    print(f"plain: vit {((preds['vit', 0] == labels).float().mean() * 100):.2f} %, "
          f"eva {((preds['eva', 0] == labels).float().mean() * 100):.2f} %")


if __name__ == "__main__":
    main()
