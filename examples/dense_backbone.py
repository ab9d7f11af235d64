"""A dense-ToMe feature pyramid, as a segmentation or detection backbone builds it: timm's features_only with
a dense method name, four stride-16 maps resampled to strides 4, 8, 16 and 32 (the simple ViTDet-style
pyramid), and the backbone's GMACs against the plain backbone, counted from the run.

    python examples/dense_backbone.py                       # ViT-S/16 at 512 px, k = 32 r merges per block
    python examples/dense_backbone.py --model vit_base_patch16_224 --r 8
"""
import argparse
import sys
from typing import List, Optional

import timm
import torch
import torch.nn.functional as F
from torch import nn

import timm_tokcomp  # noqa: F401  (registers the method names)
from timm_tokcomp.measure.counting import count_macs


class SimplePyramid(nn.Module):
    """Four stride-16 ViT maps -> strides 4, 8, 16, 32 (upsampled twice, once, kept, pooled)."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        c2, c3, c4, c5 = self.backbone(x)
        return [F.interpolate(c2, scale_factor=4.0, mode="bilinear"), F.interpolate(c3, scale_factor=2.0, mode="bilinear"),
                c4, F.max_pool2d(c5, 2)]


def build(model: str, tag: Optional[str], size: int) -> nn.Module:
    name = f"{model}.{tag}" if tag else model
    backbone = timm.create_model(name, features_only=True, out_indices=(2, 5, 8, 11), img_size=size)
    return SimplePyramid(backbone).eval()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_small_patch16_224")
    parser.add_argument("--size", type=int, default=512, help="input side in pixels (default %(default)s)")
    parser.add_argument("--r", type=int, default=16, help="dense ToMe degree: k = 32 r merges per block")
    args = parser.parse_args(argv)
    x = torch.randn(1, 3, args.size, args.size)
    plain, dense = build(args.model, None, args.size), build(args.model, f"dense_tome_r{args.r}", args.size)
    with torch.no_grad():
        maps = dense(x)
    print("pyramid:", ", ".join(f"{tuple(m.shape[1:])} (stride {args.size // m.shape[-1]})" for m in maps))
    plain_macs, dense_macs = count_macs(plain, x) / 1e9, count_macs(dense, x) / 1e9
    print(f"backbone GMACs at {args.size} px: plain {plain_macs:.2f}, dense_tome_r{args.r} {dense_macs:.2f} "
          f"({plain_macs / dense_macs:.2f}x fewer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
