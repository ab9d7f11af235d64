"""ONNX export of reduced models (`tokcomp export`), for onnxruntime and other ONNX runtimes.

Fixed-setting methods export (with an r, flops_ratio or keep_rate schedule): plain, ToMe, EViT, Top-K, DPC-KNN,
the radial patterns, dense_tome, and the learned PYRA, PatchMerger, Sinkhorn, SiT and DynamicViT (inference
form, with their parameters); each is checked against onnxruntime by the tests. ATM and ATS do not: how many
tokens they keep is read from the data (a host-side count per block), which a static graph cannot express. Not
yet: K-Medoids (round-off flips its near-tied cluster assignments in onnxruntime). Needs the `export` extra
(onnx, onnxscript; onnxruntime to check the result)."""
import contextlib
import copy
import io
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from ..core import apply, get_reducer, is_reduced
from ..utils.extras import require
from ..methods import exportable_methods, is_method_tag, parse_method_tag
from ..models.build import build_base_model
from ..files.outputs import new_output, refuse_existing

OPSET = 18


def check_exportable(model: nn.Module) -> None:
    """Raise ValueError naming the method when the model's reduction cannot become a static graph."""
    if is_reduced(model) and not get_reducer(model).exportable():
        name, why = get_reducer(model).name, get_reducer(model).spec.export_refusal
        raise ValueError(f"method {name!r} cannot be exported to ONNX: {why}; exportable: plain models and "
                         f"{', '.join(exportable_methods())} (fixed r, flops_ratio or keep_rate)")


def _translations() -> Dict:
    """aten ops the ONNX translation library lacks, written in ONNX ops."""
    from onnxscript import opset18 as op

    def sort_stable(self, stable: Optional[bool] = None, dim: int = -1, descending: bool = False):
        # ONNX TopK breaks ties towards the lower index, which is what a stable sort does in both directions
        length = op.Shape(self, start=dim) if dim == -1 else op.Shape(self, start=dim, end=dim + 1)
        return op.TopK(self, length, axis=dim, largest=1 if descending else 0, sorted=1)

    return {torch.ops.aten.sort.stable: sort_stable}


def export_onnx(model: nn.Module, path: str, example: torch.Tensor, overwrite: bool = False) -> str:
    """Write `model` (a plain timm ViT or one reduced by an exportable method) to `path` as ONNX (opset 18) with a
    dynamic batch dimension, using torch.onnx's dynamo exporter. example: (B, 3, H, W), B >= 2, fixing the image
    size. The model itself is not changed: a copy computes attention explicitly (ONNX opset 18 has no fused
    attention; same result within fp32 rounding). Returns path."""
    require("onnxscript", "export", "ONNX export")
    require("onnx", "export", "ONNX export")
    check_exportable(model)
    if example.dim() != 4 or example.shape[0] < 2:
        raise ValueError(f"example must be a (B, 3, H, W) batch with B >= 2 (B = 1 would fix the batch size), "
                         f"got shape {tuple(example.shape)}")
    refuse_existing(path, overwrite, "--out")  # before the export's work; new_output checks again at the end
    model = copy.deepcopy(model).eval()
    for blk in getattr(model, "blocks", ()):
        blk.attn.fused_attn = False
    batch = torch.export.Dim("batch", min=1, max=4096)
    with new_output(path, overwrite, "--out") as tmp, contextlib.redirect_stdout(io.StringIO()):  # the exporter's progress lines
        program = torch.onnx.export(model, (example,), dynamo=True, dynamic_shapes=({0: batch},),
                                    opset_version=OPSET, custom_translation_table=_translations(),
                                    input_names=["images"], output_names=["logits"], verbose=False)
        program.save(tmp)
    return path


def build_named(name: str, method: Optional[str], checkpoint: Optional[str], pretrained: bool
                ) -> Tuple[nn.Module, Optional[str]]:
    """(the model `tokcomp export` writes, on the CPU, and its method tag or None): name is a timm architecture or a
    method-tagged name ('deit_tiny_patch16_224.tome_r16'), method a tag for an untagged name."""
    arch, _, last = name.rpartition(".")
    tagged = bool(arch) and is_method_tag(last)
    if tagged and method:
        raise ValueError(f"MODEL {name!r} already carries a method tag; drop --method or the tag")
    model = build_base_model(arch if tagged else name, checkpoint, pretrained, "cpu")
    tag = last if tagged else method
    if tag:
        reduction, params = parse_method_tag(tag)
        apply(model, reduction, **params)
    return model, tag


def onnx_runner(path: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A callable running the ONNX file in onnxruntime on the CPU: images (B, 3, H, W) -> logits tensor."""
    ort = require("onnxruntime", "export", "running an ONNX export")
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name

    def run(images: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run(None, {name: images.cpu().numpy()})[0])

    return run


def compare_onnxruntime(model: nn.Module, path: str, images: torch.Tensor) -> Tuple[float, Tuple[int, ...]]:
    """Run the exported file in onnxruntime (CPU) on images: (B, 3, H, W); returns (max |ORT - PyTorch| over the
    logits, ORT's output shape)."""
    got = onnx_runner(path)(images)
    with torch.no_grad():
        want = model.eval()(images).float().cpu()
    return float((got - want).abs().max()), tuple(got.shape)
