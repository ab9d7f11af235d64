"""ToCom self-distillation trainer (labels never needed). Runs in one process or under
`torchrun --nproc_per_node=N` (DDP; gloo on CPU, nccl on GPU).

Each step draws (m, n) from {0..S}^2, m != n, the same on every rank. Teacher: the frozen model, no
plugins, method r = m. Student: the frozen model plus s * sign(n - m) * sum of plugins i in
[min(m, n), max(m, n)), method r = n, the plugins running un-merged (x A^T B^T added to the q / v
outputs of every block's qkv). Loss: KL(teacher || student) on softmax(logits / T) times T^2, or L1 on
the pooled features of a model without a head.
"""
import copy
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Tuple

import torch
from torch import nn

from ..core import apply, remove, set_params
from ..utils.extras import require
from ..files.identity import data_digest, weights_digest
from ..methods import tocom_methods
from ..families import patched_family, resolve
from .config import CROP_SCALE, SEED, CheckedFields, choice_field, int_field, list_field, real_field
from .engine import Schedule, TrainingDiverged, TrainingTask, check_loop_settings, distill_loss, rank_and_world, train
from ..tocom.compensator import Compensator
from ..tocom.plugins import Plugins
from .tocom_heldout import HeldoutReport, choose_scale, results_summary, write_report
from .mosaic import split_images

RUN_ENTRIES = ("tocom_config.json", "README.md", "step_*", "training")  # what a run writes into --out
HOLDOUT_PICKS = ("spread", "end")


@dataclass
class TrainConfig(CheckedFields):
    """Hyper-parameters. lr is per 256 images (scaled by the global batch size); warmup_steps None =
    5% of steps; holdout: images never trained on, for the held-out loss and for choosing the inference
    scale among scale_grid, picked evenly spaced through the folder's sorted order (holdout_pick
    "spread": a folder sorted by class is held out across its classes) or as its last images ("end")."""

    steps: int = 1100
    batch_size: int = 32
    lr: float = 0.03
    weight_decay: float = 0.01
    warmup_steps: Optional[int] = None
    temperature: float = 1.0
    scale: float = 0.1
    rank: int = 2
    groups: int = 16
    method: str = "tome"
    crop_scale: Tuple[float, float] = (0.5, 1.0)
    mosaic: Tuple[int, ...] = (2, 3)
    holdout: int = 500
    holdout_pick: str = "spread"
    scale_grid: Tuple[float, ...] = (0.05, 0.075, 0.1, 0.125, 0.15)
    scale_targets: Tuple[int, ...] = (4, 8, 12, 16)
    checkpoint_every: int = 50
    seed: int = 0
    amp: Optional[bool] = None  # None: on for CUDA, off on CPU
    amp_dtype: str = "bfloat16"
    accumulate: int = 1  # batches per optimiser step (the global batch is batch_size x processes x accumulate)

    FIELDS = (*(int_field(name, 1) for name in ("steps", "batch_size", "groups", "checkpoint_every")),
              int_field("rank", 1, "--lora-rank"), int_field("warmup_steps", 0, allow_none=True),
              int_field("holdout", 0), SEED,
              real_field("lr", shown="--lr-base"), *(real_field(name) for name in ("temperature", "scale")),
              real_field("weight_decay", strict=False),
              choice_field("holdout_pick", HOLDOUT_PICKS), choice_field("method", tocom_methods()), CROP_SCALE,
              list_field("mosaic", 1, True, "grid sizes"), list_field("scale_grid", 0.0, False, "scales"),
              list_field("scale_targets", 1, True, "targets r"))

    def validate(self) -> None:
        """Raise ValueError naming the command-line flag of the first bad hyper-parameter, before any work."""
        self.validate_fields()
        if self.warmup_steps is not None and not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"--warmup-steps must be in [0, steps={self.steps}), got {self.warmup_steps}")
        if not self.scale_targets or not all(0 < t <= self.groups for t in self.scale_targets):
            raise ValueError(f"--scale-targets must be in [1, groups={self.groups}], got {self.scale_targets}")
        check_loop_settings(self.amp, self.amp_dtype, self.accumulate)


def draw_pair(step: int, seed: int, groups: int) -> Tuple[int, int]:
    """(r_src, r_tgt), uniform over {0..groups}^2 with r_src != r_tgt; a function of (seed, step) only,
    so every rank and a resumed run draw the same pairs."""
    rng = random.Random(seed * 1_000_003 + step)
    m = rng.randint(0, groups)
    n = rng.randint(0, groups - 1)
    return m, n + (n >= m)


def warmup_steps(config: TrainConfig) -> int:
    """The linear warm-up before the cosine decay: config.warmup_steps, default 5% of the steps."""
    return config.warmup_steps if config.warmup_steps is not None else config.steps // 20


class Student(nn.Module):
    """What DDP wraps: the frozen model (kept in eval mode) with its hooked plugins, the only trainable parameters."""

    def __init__(self, model: nn.Module, plugins: Plugins) -> None:
        super().__init__()
        self.model = model
        self.plugins = plugins

    def train(self, mode: bool = True) -> "Student":
        super().train(mode)
        self.model.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class ToComTask(TrainingTask):
    """Self-distillation of the plugins between random pairs of compression degrees (module docstring); at the
    end, the held-out losses choose the inference scale and rank 0 saves the adapter repository."""

    name = "train ToCom"
    log_columns = ("r_src", "r_tgt", "loss")

    def __init__(self, model: nn.Module, data: str, base_model: str, config: TrainConfig, device: str, world: int,
                 show_progress: bool) -> None:
        self.model, self.config, self.base_model, self.device = model, config, base_model, device
        self.world, self.show_progress = world, show_progress
        self.train_set, self.heldout_set = split_images(data, model, config)
        per_step = config.batch_size * world * config.accumulate
        if len(self.train_set) < per_step:
            raise ValueError(f"--data has {len(self.train_set) + len(self.heldout_set)} images; with --holdout "
                             f"{config.holdout} that leaves fewer than one global batch ({config.batch_size} x {world} "
                             f"processes x {config.accumulate} accumulated)")
        model.to(device).eval().requires_grad_(False)
        self.has_head = getattr(model, "num_classes", 0) > 0
        apply(model, config.method, r=0)
        attn = model.blocks[0].attn
        init = Compensator.init(config.groups, len(model.blocks), attn.qkv.in_features, attn.qkv.out_features // 3,
                                config.rank, config.scale, generator=torch.Generator().manual_seed(config.seed))
        self.plugins = Plugins(init).to(device)
        self.plugins.install(model)
        self.module = Student(model, self.plugins)
        self.schedule = Schedule(
            steps=config.steps, steps_per_epoch=len(self.train_set) // per_step, batch_size=config.batch_size,
            lr=config.lr * per_step / 256, weight_decay=config.weight_decay, warmup_steps=warmup_steps(config),
            seed=config.seed, checkpoint_every=config.checkpoint_every, accumulate=config.accumulate,
            amp=config.amp, amp_dtype=config.amp_dtype)

    def loss(self, batch, step):
        x, config = batch[0], self.config
        m, n = draw_pair(step, config.seed, config.groups)
        with torch.no_grad():
            set_params(self.model, r=m)
            teacher = self.model(x)
        set_params(self.model, r=n)
        with self.plugins.active(m, n, config.scale):
            loss = distill_loss(self.forward(x), teacher, config.temperature, self.has_head)
        return {"loss": loss, "r_src": m, "r_tgt": n}

    def finish(self, out: Path, writer: bool, seconds: float) -> Tuple[Compensator, Optional[HeldoutReport]]:
        config = self.config
        rank = rank_and_world()[0]
        report, chosen = choose_scale(self.model, self.plugins, self.heldout_set, config, self.has_head, self.autocast,
                                      self.device, self.show_progress and writer, rank, self.world)
        losses = [] if report is None else [*report.loss.values(), *(v for per in report.loss_compensated.values()
                                                                     for v in per.values())]
        if not all(math.isfinite(v) for v in losses):
            raise TrainingDiverged("the held-out distillation losses are not finite (check --temperature); "
                                   "no compensator saved")
        compensator = self.plugins.to_compensator(chosen)
        if writer:
            from ..tocom.hub import save

            write_report(out / "training", report, config, chosen)
            save(compensator, str(out), self.base_model, method=config.method,
                 method_settings={"r": list(range(config.groups + 1))},
                 training=_training_summary(config, self.world, len(self.train_set)),
                 results=results_summary(report, chosen), overwrite=True)  # the run folder's policy holds here
        return compensator, report

    def interrupted(self) -> Tuple[Compensator, None]:
        return self.plugins.to_compensator(self.config.scale), None

    def close(self) -> None:
        self.plugins.remove()
        remove(self.model)


def train_tocom(model: nn.Module, data: str, out: str, base_model: str, config: TrainConfig = TrainConfig(),
                resume: bool = False, device: str = "cpu", show_progress: bool = True, num_workers: int = 2,
                stop_after: Optional[int] = None, overwrite: bool = False) -> Tuple[Compensator, Optional[HeldoutReport]]:
    """Train plugins for `model` (frozen, any timm ViT) on the images in `data` (labels ignored; config.holdout of
    them held out) and save the adapter repository to `out` (plus out/training/: checkpoint, loss log, held-out
    report), through the training engine (training.engine.train: run folder and lock, resume, DDP under
    torch.distributed with rank 0 writing, AMP, divergence checks). Returns the compensator (at the chosen scale)
    and the held-out report; after stop_after steps, the plugins at the training scale and None (resume
    continues). `model` itself is left as it came (mode, requires_grad, device, a method applied to it): the
    training runs on a copy, without the copy's method."""
    config.validate()
    resolve(model)
    require("peft", "tocom", "tokcomp train-tocom")  # what saves the adapters, checked before any work
    model = copy.deepcopy(model)
    if patched_family(model) is not None:
        remove(model)
    run = {"base_model": base_model, "weights_sha256": weights_digest(model), "data_sha256": data_digest(data)}
    return train(lambda device, world: ToComTask(model, data, base_model, config, device, world, show_progress),
                 out, RUN_ENTRIES, asdict(config), run, resume=resume, overwrite=overwrite, device=device,
                 show_progress=show_progress, num_workers=num_workers, stop_after=stop_after, seed=config.seed,
                 old_settings={"holdout_pick": "end"})  # checkpoints from before holdout_pick held out the last images


def _training_summary(config: TrainConfig, world: int, images: int) -> str:
    return (f"Self-distillation (labels never used) on {images} images, {config.steps} steps of "
            f"{config.batch_size * world * config.accumulate} images ({world} process{'es' if world > 1 else ''}"
            f"{f', {config.accumulate} batches accumulated' if config.accumulate > 1 else ''}); pairs (m, n) uniform over "
            f"{{0..{config.groups}}}^2, m != n; teacher = frozen model at {config.method} r = m, student = frozen "
            f"model + plugins at r = n; KL on softmax(logits / {config.temperature:g}); AdamW, lr "
            f"{config.lr:g} per 256 images, cosine schedule, weight decay {config.weight_decay:g}; training scale "
            f"s = {config.scale:g}; inputs are g x g mosaics (g in {', '.join(map(str, config.mosaic))}) of random "
            f"resized crops (area {config.crop_scale[0]:g}-{config.crop_scale[1]:g}) with flips.")
