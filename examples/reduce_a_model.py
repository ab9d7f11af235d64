"""Reduce a timm ViT you already have, inspect what happened, switch r live, and restore it.

    python examples/reduce_a_model.py            # random weights, runs offline
"""
import timm
import torch

import timm_tokcomp
from timm_tokcomp.measure.counting import count_macs

model = timm.create_model("deit_tiny_patch16_224").eval()  # pretrained=True needs the Hugging Face Hub
x = torch.randn(2, 3, 224, 224)
plain_macs = count_macs(model, x) / len(x)

timm_tokcomp.apply(model, method="tome", r=16)
with torch.no_grad():
    model(x)
stats = timm_tokcomp.last_stats(model)
print("tokens entering each block:", stats.tokens_per_block)
print(f"GMACs per image: {plain_macs / 1e9:.3f} -> {count_macs(model, x) / len(x) / 1e9:.3f}")

timm_tokcomp.set_params(model, r=8)  # same model, lighter reduction
timm_tokcomp.set_params(model, flops_ratio=2.0)  # or a decreasing schedule for half the MACs
print(f"flops_ratio=2: GMACs per image {count_macs(model, x) / len(x) / 1e9:.3f}, tokens per block",
      timm_tokcomp.last_stats(model).tokens_per_block)
timm_tokcomp.remove(model)  # the plain timm model again
