"""Semantic segmentation with a token-merging ViT backbone (the dense variant: every block merges
k = 32 r tokens before its MLP and unmerges after it, so every patch keeps a prediction) and a small
Segmenter-style mask-transformer decoder. Runs on the CPU with synthetic images: a forward, one
training step, and mIoU.

    python examples/segmentation.py [--r 2] [--steps 1]
"""
import argparse
import sys
from typing import List, Tuple

import timm
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Block
from torch import nn

import timm_tokcomp


class MaskTransformer(nn.Module):
    """Segmenter's decoder: class embeddings go through transformer layers together with the patch
    tokens; masks are the products of L2-normalised patch and class features, upsampled bilinearly."""

    def __init__(self, num_classes: int, encoder_dim: int, dim: int = 192, depth: int = 2, heads: int = 3) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.proj_in = nn.Linear(encoder_dim, dim)
        self.class_embed = nn.Parameter(torch.randn(1, num_classes, dim) * 0.02)
        self.layers = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.proj_patch = nn.Linear(dim, dim, bias=False)
        self.proj_class = nn.Linear(dim, dim, bias=False)
        self.mask_norm = nn.LayerNorm(num_classes)

    def forward(self, patches: torch.Tensor, grid: Tuple[int, int], image_size: Tuple[int, int]) -> torch.Tensor:
        """patches: (B, h*w, C_enc) -> logits (B, num_classes, H, W)."""
        x = torch.cat([self.proj_in(patches), self.class_embed.expand(len(patches), -1, -1)], dim=1)
        x = self.norm(self.layers(x))
        p, c = x[:, : -self.num_classes], x[:, -self.num_classes:]
        p = F.normalize(self.proj_patch(p), dim=-1)
        c = F.normalize(self.proj_class(c), dim=-1)
        masks = self.mask_norm(p @ c.transpose(1, 2))  # (B, h*w, K)
        masks = masks.transpose(1, 2).reshape(len(patches), self.num_classes, *grid)
        return F.interpolate(masks, size=image_size, mode="bilinear", align_corners=False)


class Segmenter(nn.Module):
    def __init__(self, backbone: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.decoder = MaskTransformer(num_classes, backbone.embed_dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images: (B, 3, H, W) -> logits (B, num_classes, H, W)."""
        tokens = self.backbone.forward_features(images)[:, self.backbone.num_prefix_tokens:]
        grid = self.backbone.patch_embed.dynamic_feat_size(images.shape[-2:])
        return self.decoder(tokens, grid, images.shape[-2:])


def mean_iou(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> float:
    """Mean over the classes present in pred or target of |pred ∩ target| / |pred ∪ target|.
    pred, target: (B, H, W) integer class maps."""
    ious: List[float] = []
    for k in range(num_classes):
        p, t = pred == k, target == k
        union = (p | t).sum().item()
        if union:
            ious.append((p & t).sum().item() / union)
    return sum(ious) / len(ious) if ious else float("nan")


def synthetic_batch(batch: int, size: int, num_classes: int, generator: torch.Generator):
    """Images of coloured rectangles on noise, and their class maps (class 0 = background)."""
    images = 0.2 * torch.randn(batch, 3, size, size, generator=generator)
    target = torch.zeros(batch, size, size, dtype=torch.long)
    colours = torch.randn(num_classes, 3, generator=generator)
    for b in range(batch):
        for k in range(1, num_classes):
            y0, x0 = torch.randint(0, size // 2, (2,), generator=generator).tolist()
            h, w = torch.randint(size // 8, size // 2, (2,), generator=generator).tolist()
            images[b, :, y0:y0 + h, x0:x0 + w] += colours[k].view(3, 1, 1)
            target[b, y0:y0 + h, x0:x0 + w] = k
    return images, target


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--r", type=int, default=2, help="compression degree (k = 32 r merges per block)")
    parser.add_argument("--size", type=int, default=192, help="image side in pixels (any multiple of 16)")
    parser.add_argument("--steps", type=int, default=1, help="training steps")
    args = parser.parse_args(argv)

    num_classes = 4
    backbone = timm.create_model("vit_tiny_patch16_224", dynamic_img_size=True, num_classes=0)
    timm_tokcomp.apply(backbone, "dense_tome", r=args.r)
    model = Segmenter(backbone, num_classes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    images, target = synthetic_batch(2, args.size, num_classes, g)

    model.train()
    for step in range(args.steps):
        loss = F.cross_entropy(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")

    model.eval()
    with torch.no_grad():
        logits = model(images)
    h, w = backbone.patch_embed.dynamic_feat_size(images.shape[-2:])
    print(f"logits {tuple(logits.shape)}, mIoU {mean_iou(logits.argmax(dim=1), target, num_classes):.3f} "
          f"(dense_tome r={args.r}: up to {32 * args.r} of {h * w} patch tokens merged before each MLP)")


if __name__ == "__main__":
    main(sys.argv[1:])
