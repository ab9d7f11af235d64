"""Eager aten ops and host synchronisations per forward of DeiT-Tiny (batch 2, random weights, CPU), plain and with
ToMe, EViT, ATM and DPC-KNN: what a GPU pays per forward, counted on the CPU (measure.OpCounter). Run it on two
commits to compare a refactor's cost:

    python scripts/count_forward_ops.py"""
import timm
import torch

import timm_tokcomp
from timm_tokcomp.measure import OpCounter

SETTINGS = (("plain", None, {}), ("tome_r16", "tome", {"r": 16}), ("evit_r8", "evit", {"r": 8}),
            ("atm", "atm", {}), ("dpcknn_k70", "dpcknn", {"keep_rate": 0.7}))


def count(method, params):
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224").eval()
    if method:
        timm_tokcomp.apply(model, method, **params)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(x)  # the first forward makes what later ones reuse
        with OpCounter() as ops:
            model(x)
    return ops.total, ops.host_syncs


if __name__ == "__main__":
    print("setting     aten ops  host syncs")
    for name, method, params in SETTINGS:
        total, syncs = count(method, params)
        print(f"{name:<11} {total:>8}  {syncs:>10}")
