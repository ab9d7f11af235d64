"""A preset deployed in one call: the method applied with its recorded kernel and attention implementation, the
model on the recorded device, every call under the recorded precision, in the recorded execution mode. What
`tokcomp tune` timed, as a callable.

    runner = timm_tokcomp.deploy(model, "tuned/preset_b32.json")   # model: the plain timm model tune measured
    logits = runner(images)                                          # images: (B, 3, H, W), any device
"""
import threading
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from ..core import NO_REDUCTION, apply, is_reduced
from ..measure.precision import check_device, precision
from . import modes
from .presets import Preset, read_preset, warn_if_conditions_differ


class Deployment:
    """model run as preset says. Calls take images (B, 3, H, W) on any device and return the outputs on the
    deployment's device. A CUDA-graph mode captures once per input shape (a first call of a new batch size
    captures it); compiled modes compile once per shape. The model must not change afterwards."""

    def __init__(self, model: nn.Module, preset: Preset, device: str, tf32: bool) -> None:
        self.model, self.preset, self.device, self.tf32 = model, preset, device, tf32
        self.mode, self.dtype = preset.mode, preset.dtype
        self._runners: Dict[Tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]] = {}
        self._building = threading.Lock()

    def _runner(self, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        key = tuple(x.shape) if self.mode == "graph" else ()
        with self._building:
            if key not in self._runners:
                self._runners[key] = modes.runner(self.model, self.mode, x)
            return self._runners[key]

    @torch.inference_mode()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.device)
        with precision(self.device, self.dtype, self.tf32):
            return self._runner(x)(x)

    def __repr__(self) -> str:
        return (f"Deployment({self.preset.method} {self.preset.params}, device {self.device}, {self.dtype}, "
                f"mode {self.mode})")


def deploy(model: nn.Module, preset: str, device: Optional[str] = None) -> Deployment:
    """Apply the preset file written by `tokcomp tune` (or `tokcomp calibrate`) to model (a plain timm ViT), move
    it to the recorded device (or `device`, e.g. 'cuda:1') in eval mode, and return a Deployment: a callable that
    runs every call under the recorded precision (autocast dtype, TF32) in the recorded execution mode (eager,
    compile, cudagraph or graph). A preset of method 'none' runs the plain model in that mode. Warns, as
    load_preset does, when versions or the device differ from the tune's."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a timm model (nn.Module), got {type(model).__name__}")
    if is_reduced(model):
        raise ValueError("deploy takes the plain model: this one already reduces tokens "
                         "(timm_tokcomp.remove(model) first, or build it again)")
    loaded = read_preset(preset, warn=False)
    target = device or loaded.device or "cpu"
    check_device(target, "device=" if device else f"preset {preset}: its recorded device")
    warn_if_conditions_differ(preset, loaded, target, loaded.dtype, None)
    modes.check_mode(loaded.mode, target, loaded.dtype, flag=f"preset {preset}: execution mode",
                     allowed=modes.TORCH_MODES)
    if loaded.method != NO_REDUCTION:  # first: a refusal leaves the model as it was (device, mode, classes)
        apply(model, loaded.method, **loaded.params)
    model = model.to(target).eval()
    return Deployment(model, loaded, target, bool(loaded.tuned.get("tf32", False)))
