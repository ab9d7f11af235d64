"""`tokcomp export`: a plain or reduced model as ONNX, checked in onnxruntime."""
import argparse
import sys

from ..methods import exportable_methods
from .flags import FILE_OUT, model_flags, weights_flags


def add(sub: argparse._SubParsersAction) -> None:
    exportable = exportable_methods()
    ex = sub.add_parser("export", help=f"write a plain or reduced model ({', '.join(exportable)}) as ONNX (dynamic "
                                       f"batch) and check it in onnxruntime")
    model_flags(ex, "timm architecture (or open_clip:ARCH), or a tagged name such as deit_tiny_patch16_224.tome_r16")
    ex.add_argument("--method", help=f"method tag of {', '.join(exportable)} (atm, ats and kmedoids do not export: "
                                     f"their token counts or round-off depend on the data)")
    weights_flags(ex)
    ex.add_argument("--out", required=True, help="the .onnx file to write")
    ex.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    ex.set_defaults(func=run, outputs=(FILE_OUT,))


def run(args: argparse.Namespace) -> int:
    import timm
    import torch

    from ..core import is_reduced
    from ..deployment.onnx import build_named, compare_onnxruntime, export_onnx

    model, tag = build_named(args.model, args.method, args.checkpoint, args.pretrained)
    size = timm.data.resolve_model_data_config(model)["input_size"]
    torch.manual_seed(0)
    export_onnx(model, args.out, torch.randn(2, *size), overwrite=args.overwrite)
    print(f"saved {args.out} ({'plain' if not is_reduced(model) else tag}, opset 18, dynamic batch, input {size})")
    try:
        diff, shape = compare_onnxruntime(model, args.out, torch.randn(3, *size))
    except ImportError as e:
        print(f"note: not checked: {e}", file=sys.stderr)
    else:
        print(f"onnxruntime (CPU) on a random batch of 3: logits {shape}, max |ONNX - PyTorch| = {diff:.2e}")
    return 0
