"""ToCom self-distillation trainer (labels never needed). Runs in one process or under
`torchrun --nproc_per_node=N` (DDP; gloo on CPU, nccl on GPU).

Each step draws (m, n) from {0..S}^2, m != n, the same on every rank. Teacher: the frozen model, no
plugins, method r = m. Student: the frozen model plus s * sign(n - m) * sum of plugins i in
[min(m, n), max(m, n)), method r = n, the plugins running un-merged (x A^T B^T added to the q / v
outputs of every block's qkv). Loss: KL(teacher || student) on softmax(logits / T) times T^2, or L1 on
the pooled features of a model without a head.
"""
import contextlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from tqdm import tqdm

from .. import apply, remove, set_params
from ..outputs import replacing, run_folder, write_text
from ..patch import check_supported
from ..schedules import is_int
from ..userfiles import read_torch
from ..training.engine import (SeededAugment, TrainingDiverged, distill_loss, epoch_batches, is_distributed,
                               warmup_cosine_lr)
from .compensator import Compensator, check_fits

CHECKPOINT = "checkpoint.pt"
LOSS_LOG = "loss_log.csv"
LOG_HEADER = "step,r_src,r_tgt,loss,lr,seconds"
HOLDOUT_PICKS = ("spread", "end")
RUN_ENTRIES = ("tocom_config.json", "README.md", "step_*", "training")  # what a run writes into --out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class TrainConfig:
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
    amp: Optional[bool] = None  # None: on for CUDA (bf16), off on CPU

    def validate(self) -> None:
        """Raise ValueError naming the command-line flag of the first bad hyper-parameter, before any work."""
        for name in ("steps", "batch_size", "rank", "groups", "checkpoint_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{_flag(name)} must be an integer >= 1, got {value!r}")
        for name in ("holdout", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{_flag(name)} must be an integer >= 0, got {value!r}")
        for name in ("lr", "temperature", "scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{_flag(name)} must be a finite number > 0, got {value!r}")
        if not (isinstance(self.weight_decay, (int, float)) and math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay!r}")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"--warmup-steps must be in [0, steps={self.steps}), got {self.warmup_steps}")
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"--crop-min must be in (0, 1] (crop_scale (lo, hi), 0 < lo <= hi <= 1), got {self.crop_scale}")
        if not self.mosaic or min(self.mosaic) < 1:
            raise ValueError(f"--mosaic must hold grid sizes >= 1, got {self.mosaic}")
        if self.holdout_pick not in HOLDOUT_PICKS:
            raise ValueError(f"--holdout-pick must be one of {', '.join(HOLDOUT_PICKS)}, got {self.holdout_pick!r}")
        if self.method not in ("tome", "evit"):
            raise ValueError(f"--method must be 'tome' or 'evit', got {self.method!r}")
        if not self.scale_grid or not all(math.isfinite(s) and s > 0 for s in self.scale_grid):
            raise ValueError(f"--scale-grid must hold finite scales > 0, got {self.scale_grid}")
        if not self.scale_targets or not all(0 < t <= self.groups for t in self.scale_targets):
            raise ValueError(f"--scale-targets must be in [1, groups={self.groups}], got {self.scale_targets}")


class Plugins(nn.Module):
    """Trainable plugins lora_a (S, L, 2, h, D), lora_b (S, L, 2, attn_dim, h) for [query, value],
    added un-merged to the output of every block's qkv while a pair is active."""

    def __init__(self, compensator: Compensator) -> None:
        super().__init__()
        self.lora_a = nn.Parameter(compensator.lora_a.clone().float())
        self.lora_b = nn.Parameter(compensator.lora_b.clone().float())
        self._active: Optional[Tuple[int, int, float]] = None
        self._handles: List = []

    def install(self, model: nn.Module) -> None:
        """Hook every block's attn.qkv; the hooks do nothing until a pair is active."""
        check_fits(model, self.to_compensator(1.0))
        for block, blk in enumerate(model.blocks):
            self._handles.append(blk.attn.qkv.register_forward_hook(self._hook(block)))

    def _hook(self, block: int) -> Callable:
        def add_plugins(module: nn.Module, inputs: Tuple[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
            if self._active is None:
                return out
            lo, hi, coef = self._active
            x = inputs[0]  # (B, N, D)
            k, h, D = hi - lo, self.lora_a.shape[3], self.lora_a.shape[4]
            a = self.lora_a[lo:hi, block].transpose(0, 1).reshape(2, k * h, D)  # (2, k h, D)
            b = self.lora_b[lo:hi, block].permute(1, 2, 0, 3).reshape(2, -1, k * h)  # (2, attn_dim, k h)
            dq = (x @ a[0].t().to(x.dtype)) @ b[0].t().to(x.dtype)
            dv = (x @ a[1].t().to(x.dtype)) @ b[1].t().to(x.dtype)
            return out + coef * torch.cat([dq, torch.zeros_like(dq), dv], dim=-1).to(out.dtype)

        return add_plugins

    @contextlib.contextmanager
    def active(self, source_r: int, target_r: int, scale: float) -> Iterator[None]:
        """Within the block, the hooks add s * sign(n - m) * sum of plugins [min, max) (m = source_r)."""
        lo, hi = sorted((source_r, target_r))
        self._active = None if lo == hi else (lo, hi, scale * (1.0 if target_r > source_r else -1.0))
        try:
            yield
        finally:
            self._active = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def to_compensator(self, scale: float) -> Compensator:
        return Compensator(self.lora_a.detach().cpu().clone(), self.lora_b.detach().cpu().clone(), scale)


def draw_pair(step: int, seed: int, groups: int) -> Tuple[int, int]:
    """(r_src, r_tgt), uniform over {0..groups}^2 with r_src != r_tgt; a function of (seed, step) only,
    so every rank and a resumed run draw the same pairs."""
    rng = random.Random(seed * 1_000_003 + step)
    m = rng.randint(0, groups)
    n = rng.randint(0, groups - 1)
    return m, n + (n >= m)


def lr_at(step: int, config: TrainConfig, base_lr: float) -> float:
    """Linear warmup (warmup_steps, default 5% of steps) then cosine decay to 0 (step counts from 0)."""
    warmup = config.warmup_steps if config.warmup_steps is not None else config.steps // 20
    return warmup_cosine_lr(step, config.steps, warmup, base_lr)


class Mosaic(torch.utils.data.Dataset):
    """Training images: a g x g grid (g drawn from `grids`) of random resized crops (area in
    crop_scale, bicubic, random flip) filling the model's input size; tile 0 is image i, the others are
    random images. Tiles of input_size / g upscale small images less, so their tokens carry detail
    closer to a photo's. Returns (normalised (3, H, W) tensor, -1)."""

    def __init__(self, images: torch.utils.data.Dataset, model: nn.Module, grids: Sequence[int],
                 crop_scale: Tuple[float, float]) -> None:
        import timm
        from torchvision import transforms

        cfg = timm.data.resolve_model_data_config(model)
        self.images, self.grids, self.crop_scale = images, tuple(grids), crop_scale
        self.height, self.width = cfg["input_size"][-2:]
        self.finish = transforms.Compose([transforms.ToTensor(), transforms.Normalize(cfg["mean"], cfg["std"])])

    def __len__(self) -> int:
        return len(self.images)

    def _tile(self, j: int, height: int, width: int):
        from torchvision import transforms

        crop = transforms.RandomResizedCrop((height, width), scale=self.crop_scale,
                                            interpolation=transforms.InterpolationMode.BICUBIC)
        return transforms.RandomHorizontalFlip()(crop(self.images[j][0]))

    def __getitem__(self, i: int):
        from PIL import Image

        g = self.grids[int(torch.randint(len(self.grids), ()))]
        rows = [round(k * self.height / g) for k in range(g + 1)]
        cols = [round(k * self.width / g) for k in range(g + 1)]
        canvas = Image.new("RGB", (self.width, self.height))
        for t in range(g * g):
            j = i if t == 0 else int(torch.randint(len(self.images), ()))
            r, c = divmod(t, g)
            canvas.paste(self._tile(j, rows[r + 1] - rows[r], cols[c + 1] - cols[c]), (cols[c], rows[r]))
        return self.finish(canvas), -1


class _Student(nn.Module):
    """What DDP wraps: the frozen model with its hooked plugins (the only trainable parameters)."""

    def __init__(self, model: nn.Module, plugins: Plugins) -> None:
        super().__init__()
        self.model = model
        self.plugins = plugins

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


@dataclass
class HeldoutReport:
    """Mean held-out distillation losses: loss[(m, n)] uncompensated, loss_compensated[s][(m, n)];
    chosen_scale: the scale with the lowest mean loss."""

    images: int
    loss: Dict[Tuple[int, int], float]
    loss_compensated: Dict[float, Dict[Tuple[int, int], float]] = field(default_factory=dict)
    chosen_scale: Optional[float] = None

    def objective(self, scale: float, pairs: Sequence[Tuple[int, int]]) -> float:
        return sum(self.loss_compensated[scale][p] for p in pairs) / len(pairs)

    def changes(self, scale: float) -> List[Tuple[Tuple[int, int], float, float, float]]:
        """Per pair: (pair, loss without plugins, loss with them at scale, relative change in %)."""
        return [(pair, plain, self.loss_compensated[scale][pair],
                 100 * (self.loss_compensated[scale][pair] - plain) / plain) for pair, plain in self.loss.items()]


@torch.no_grad()
def heldout_losses(model: nn.Module, plugins: Plugins, batches: Iterable[torch.Tensor], pairs: Sequence[Tuple[int, int]],
                   scales: Sequence[float], config: TrainConfig, has_head: bool, autocast: Callable,
                   progress: Optional[Callable[[], None]] = None) -> HeldoutReport:
    """Distillation loss per pair, without plugins and with them at every scale, averaged over images.
    Under torch.distributed each rank passes its share of the batches and gets the mean over all."""
    keys = [(s, p) for s in [None, *scales] for p in pairs]
    slot = {key: i for i, key in enumerate(keys)}
    totals = torch.zeros(len(keys) + 1, dtype=torch.float64)  # loss sums per key, then the image count
    for x in batches:
        for m in sorted({p[0] for p in pairs}):
            set_params(model, r=m)
            with autocast():
                teacher = model(x)
            for p in (p for p in pairs if p[0] == m):
                set_params(model, r=p[1])
                for s in [None, *scales]:
                    with autocast(), (plugins.active(*p, s) if s is not None else contextlib.nullcontext()):
                        loss = distill_loss(model(x), teacher, config.temperature, has_head)
                    totals[slot[(s, p)]] += loss.item() * len(x)
                    if progress:
                        progress()
        totals[-1] += len(x)
    if is_distributed():
        summed = totals.to(plugins.lora_a.device)
        torch.distributed.all_reduce(summed)
        totals = summed.cpu()
    count = int(totals[-1])
    mean = {key: totals[i].item() / count for key, i in slot.items()}
    report = HeldoutReport(count, {p: mean[(None, p)] for p in pairs})
    report.loss_compensated = {s: {p: mean[(s, p)] for p in pairs} for s in scales}
    return report


def _kept(last_saved: int) -> str:
    return f"the checkpoint of step {last_saved} is intact" if last_saved else "no checkpoint had been written"


def _check_finite(plugins: Plugins, step: int, last_saved: int) -> None:
    if not (torch.isfinite(plugins.lora_a).all() and torch.isfinite(plugins.lora_b).all()):
        raise TrainingDiverged(f"training diverged: the plugins are not finite after step {step}; nothing of it is "
                               f"saved ({_kept(last_saved)}). Lower --lr.")


def _save_checkpoint(path: Path, step: int, plugins: Plugins, optimizer: torch.optim.Optimizer, config: TrainConfig,
                     world: int, log: List[str]) -> None:
    """checkpoint.pt: step, plugins, optimizer, config, world size and the loss-log lines up to step."""
    with replacing(path) as tmp:
        torch.save({"step": step, "plugins": plugins.state_dict(), "optimizer": optimizer.state_dict(),
                    "config": asdict(config), "world_size": world, "log": list(log)}, tmp)


def heldout_indices(count: int, holdout: int, pick: str) -> List[int]:
    """The `holdout` of `count` images never trained on: evenly spaced ("spread": index
    floor((k + 0.5) count / holdout), k < holdout) or the last ones ("end")."""
    if pick == "end":
        return list(range(count - holdout, count))
    return [int((k + 0.5) * count / holdout) for k in range(holdout)]


def split_images(data: str, model: nn.Module, config: TrainConfig) -> Tuple[SeededAugment, torch.utils.data.Dataset]:
    """(training mosaics, the held-out images with the model's eval transform)."""
    import timm

    from ..data import open_images

    pil = open_images(data, lambda img: img)
    evaluation = open_images(data, timm.data.create_transform(**timm.data.resolve_model_data_config(model)))
    if config.holdout >= len(pil):
        raise ValueError(f"--holdout {config.holdout} leaves no training image: --data has {len(pil)} images")
    heldout = heldout_indices(len(pil), config.holdout, config.holdout_pick)
    kept = sorted(set(range(len(pil))) - set(heldout))
    train = Mosaic(torch.utils.data.Subset(pil, kept), model, config.mosaic, config.crop_scale)
    return SeededAugment(train, config.seed), torch.utils.data.Subset(evaluation, heldout)


def train_tocom(model: nn.Module, data: str, out: str, base_model: str, config: TrainConfig = TrainConfig(),
                resume: bool = False, device: str = "cpu", show_progress: bool = True, num_workers: int = 2,
                stop_after: Optional[int] = None, overwrite: bool = False) -> Tuple[Compensator, Optional[HeldoutReport]]:
    """Train plugins for `model` (frozen, any timm ViT) on the images in `data` (labels ignored; the
    last config.holdout are held out) and save the adapter repository to `out` (plus out/training/:
    checkpoint, loss log, held-out report). Under torch.distributed every rank calls this with the same
    arguments; rank 0 writes. Returns the compensator (at the chosen scale) and the held-out report.
    stop_after: leave after that step with a checkpoint and nothing else written (resume continues);
    the report is then None. A non-empty `out` is refused (FileExistsError) unless resume (continue the
    run there) or overwrite (the previous run is set aside and deleted once this one ends; outputs.run_folder),
    and so is a second process while this run holds `out` (FileExistsError). Every file is written under a
    temporary name and renamed into place; a loss or plugins that become non-finite raise TrainingDiverged and
    nothing non-finite is saved."""
    config.validate()
    check_supported(model)
    if stop_after is not None and (not is_int(stop_after) or stop_after < 1):
        raise ValueError(f"--stop-after must be an integer >= 1, got {stop_after!r}")
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if is_distributed() else (0, 1)
    # rank 0 (the writer) holds out/.lock and sets an earlier run aside, restored if this one fails before writing
    with run_folder(out, resume, overwrite, RUN_ENTRIES, writer=rank == 0):
        return _train(model, data, out, base_model, config, resume, device, show_progress, num_workers, stop_after,
                      rank, world)


def _train(model, data, out, base_model, config, resume, device, show_progress, num_workers, stop_after, rank, world):
    """train_tocom's run, once rank 0 holds the folder's lock."""
    train_set, heldout_set = split_images(data, model, config)
    if len(train_set) < config.batch_size * world:
        raise ValueError(f"--data has {len(train_set) + len(heldout_set)} images; with --holdout {config.holdout} that "
                         f"leaves fewer than one global batch ({config.batch_size} x {world} processes)")
    work = Path(out) / "training"
    model = model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    has_head = getattr(model, "num_classes", 0) > 0
    apply(model, config.method, r=0)
    blk = model.blocks[0].attn
    attn_dim = blk.qkv.out_features // 3
    init = Compensator.init(config.groups, len(model.blocks), blk.qkv.in_features, attn_dim, config.rank, config.scale,
                            generator=torch.Generator().manual_seed(config.seed))
    plugins = Plugins(init).to(device)
    plugins.install(model)
    student = _Student(model, plugins)
    if world > 1:
        student = nn.parallel.DistributedDataParallel(student, device_ids=[device] if device.startswith("cuda") else None)
    base_lr = config.lr * config.batch_size * world / 256
    optimizer = torch.optim.AdamW(plugins.parameters(), lr=base_lr, weight_decay=config.weight_decay)
    use_amp = device.startswith("cuda") if config.amp is None else config.amp
    autocast = (lambda: torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16)) if use_amp \
        else contextlib.nullcontext

    start = 0
    checkpoint = work / CHECKPOINT
    if resume and checkpoint.is_file():
        state = read_torch(checkpoint, "--resume")  # on the CPU: load_state_dict copies to the plugins' device
        saved = {"holdout_pick": "end", **state["config"]}  # checkpoints from before holdout_pick held out the end
        if saved != asdict(config) or state["world_size"] != world:
            raise ValueError(f"--resume: {checkpoint} was written with other settings ({saved}, {state['world_size']} "
                             f"processes); give the same ones or a new --out")
        plugins.load_state_dict(state["plugins"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        if "log" in state:
            log = list(state["log"])
        else:  # a checkpoint from before the log was kept in it: the log file's lines up to its step
            log = (work / LOSS_LOG).read_text().splitlines()[1:start + 1] if (work / LOSS_LOG).is_file() else []
    else:
        log = []
        if resume and rank == 0:
            print(f"note: --resume: no {checkpoint} yet, starting from step 0", file=sys.stderr)

    per_epoch = len(train_set) // (config.batch_size * world)
    log_path = work / LOSS_LOG
    began = time.time()
    bar = tqdm(total=config.steps, initial=start, desc="train ToCom", disable=not show_progress or rank != 0,
               file=sys.stderr)
    step, ema, saved = start, None, start
    last = config.steps if stop_after is None else min(stop_after, config.steps)
    while step < last:
        epoch, skip = divmod(step, per_epoch)
        batches = epoch_batches(len(train_set), epoch, config.seed, config.batch_size, rank, world)[skip:]
        train_set.epoch = epoch
        loader = torch.utils.data.DataLoader(train_set, batch_sampler=batches[:last - step],
                                             num_workers=num_workers, persistent_workers=False)
        for x, _ in loader:
            x = x.to(device, non_blocking=True)
            m, n = draw_pair(step, config.seed, config.groups)
            lr = lr_at(step, config, base_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with torch.no_grad(), autocast():
                set_params(model, r=m)
                teacher = model(x)
            set_params(model, r=n)
            with autocast(), plugins.active(m, n, config.scale):
                loss = distill_loss(student(x), teacher, config.temperature, has_head)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            value = loss.item()
            if not math.isfinite(value):
                raise TrainingDiverged(f"training diverged: the loss is {value} at step {step} (pair {m}->{n}); nothing "
                                       f"of it is saved ({_kept(saved)}). Lower --lr.")
            ema = value if ema is None else 0.98 * ema + 0.02 * value
            log.append(f"{step},{m},{n},{value:.6f},{lr:.6g},{time.time() - began:.1f}")
            if rank == 0:
                write_text(log_path, "\n".join([LOG_HEADER, *log]) + "\n")
                bar.set_postfix_str(f"loss {ema:.4f} pair {m}->{n}", refresh=False)
                bar.update(1)
            if step % config.checkpoint_every == 0 or step == last:
                _check_finite(plugins, step, saved)
                if rank == 0:
                    _save_checkpoint(checkpoint, step, plugins, optimizer, config, world, log)
                saved = step
    bar.close()

    report = None
    if step < config.steps:
        compensator = plugins.to_compensator(config.scale)
    else:
        _check_finite(plugins, step, saved)
        report, chosen = _choose_scale(model, plugins, heldout_set, config, has_head, autocast, device,
                                       show_progress and rank == 0, rank, world)
        compensator = plugins.to_compensator(chosen)
        losses = [] if report is None else [*report.loss.values(), *(v for per in report.loss_compensated.values()
                                                                     for v in per.values())]
        if not all(math.isfinite(v) for v in losses):
            raise TrainingDiverged("the held-out distillation losses are not finite (check --temperature); "
                                   "no compensator saved")
        if rank == 0:
            _write_report(work, report, config, chosen)
            from .hub import save

            save(compensator, out, base_model, method=config.method,
                 method_settings={"r": list(range(config.groups + 1))},
                 training=_training_summary(config, world, len(train_set)), results=_results_summary(report, chosen))
    plugins.remove()
    remove(model)
    if world > 1:
        torch.distributed.barrier()
    return compensator, report


def _choose_scale(model, plugins, heldout_set, config, has_head, autocast, device, show_progress, rank, world):
    """Held-out losses and the scale among scale_grid with the lowest mean loss over (0 -> t), t in
    scale_targets; the held-out batches are shared out between the ranks. Without held-out images, the
    training scale."""
    if len(heldout_set) == 0:
        return None, config.scale
    size, n = config.batch_size, len(heldout_set)
    mine = [i for b in range(rank, math.ceil(n / size), world) for i in range(b * size, min((b + 1) * size, n))]
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(heldout_set, mine), batch_size=size)
    pairs = [(0, t) for t in config.scale_targets]
    scales = sorted(set(config.scale_grid) | {config.scale})
    with tqdm(total=len(loader) * len(pairs) * (len(scales) + 1), desc="held-out loss", file=sys.stderr,
              disable=not show_progress) as bar:
        batches = (x.to(device) for x, _ in loader)
        report = heldout_losses(model, plugins, batches, pairs, scales, config, has_head, autocast, bar.update)
    report.chosen_scale = min(scales, key=lambda s: report.objective(s, pairs))
    return report, report.chosen_scale


def _write_report(work: Path, report: Optional[HeldoutReport], config: TrainConfig, chosen: float) -> None:
    data = {"chosen_scale": chosen, "train_scale": config.scale}
    if report is not None:
        data["heldout_images"] = report.images
        data["uncompensated"] = {f"{m}->{n}": v for (m, n), v in report.loss.items()}
        data["compensated"] = {str(s): {f"{m}->{n}": v for (m, n), v in per.items()}
                               for s, per in report.loss_compensated.items()}
    write_text(work / "heldout.json", json.dumps(data, indent=2) + "\n")


def _training_summary(config: TrainConfig, world: int, images: int) -> str:
    return (f"Self-distillation (labels never used) on {images} images, {config.steps} steps of "
            f"{config.batch_size * world} images ({world} process{'es' if world > 1 else ''}); pairs (m, n) uniform over "
            f"{{0..{config.groups}}}^2, m != n; teacher = frozen model at {config.method} r = m, student = frozen "
            f"model + plugins at r = n; KL on softmax(logits / {config.temperature:g}); AdamW, lr "
            f"{config.lr:g} per 256 images, cosine schedule, weight decay {config.weight_decay:g}; training scale "
            f"s = {config.scale:g}; inputs are g x g mosaics (g in {', '.join(map(str, config.mosaic))}) of random "
            f"resized crops (area {config.crop_scale[0]:g}-{config.crop_scale[1]:g}) with flips.")


def _results_summary(report: Optional[HeldoutReport], chosen: float) -> str:
    if report is None:
        return "No held-out images (holdout = 0): nothing measured; the scale is the training scale."
    lines = [f"Distillation loss on {report.images} held-out images (never trained on), source r = 0:", "",
             "| target r | without ToCom | with ToCom (s = %g) | change |" % chosen, "|---|---|---|---|"]
    for (m, n), plain, comp, change in report.changes(chosen):
        lines.append(f"| {n} | {plain:.4f} | {comp:.4f} | {change:+.1f}% |")
    lines += ["", f"The scale s = {chosen:g} was chosen among {', '.join(f'{s:g}' for s in sorted(report.loss_compensated))} "
              f"as the lowest mean held-out loss over these targets."]
    return "\n".join(lines)
