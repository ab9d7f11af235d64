"""The one training loop. A task (ToComTask, FinetuneTask; shaped like timm's `timm/task` tasks) supplies the trainable
module, `loss(batch, step) -> dict`, its evaluation and what it saves; `train` owns everything else:

- the run folder and its lock (outputs.run_folder), seeding, the distributed process group under torchrun;
- AdamW with a linear warm-up and cosine decay, gradient accumulation, AMP autocast on CUDA (bf16, or fp16 with a
  GradScaler) or bf16 on the CPU;
- DDP around the trainable module only (a frozen teacher stays outside);
- checkpoint and resume (a resumed run is bit-identical to an uninterrupted one), the loss log, the progress bar
  on rank 0, stop-after, and TrainingDiverged before anything non-finite is saved.

Files in OUT/training: checkpoint.pt, loss_log.csv (one row per step), log.csv (one row per epoch, for tasks that
evaluate every epoch).
"""
import contextlib
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from ..core import __version__
from ..measure.precision import AMP_NAMES, DTYPES
from ..files.outputs import replacing, run_folder, write_text
from ..utils.checks import check_bool, check_choice, integer, is_int, is_real, is_version
from ..files.userfiles import read_torch

# 1: the two trainers' own checkpoints, before this engine (timm_tokcomp 0.1.0); 2: inputs by path; 3: by content;
# 4: tensors and plain values only, read back with torch.load(weights_only=True) (userfiles.read_torch)
CHECKPOINT_FORMAT = 4
CHECKPOINT = "checkpoint.pt"
STEP_LOG = "loss_log.csv"
EPOCH_LOG = "log.csv"
AMP_DTYPES = {name: DTYPES[short] for name, short in AMP_NAMES.items()}  # --amp-dtype spells them as timm does


class TrainingDiverged(RuntimeError):
    """The loss or the trained parameters became non-finite; nothing non-finite was saved."""


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank_and_world() -> Tuple[int, int]:
    return (torch.distributed.get_rank(), torch.distributed.get_world_size()) if is_distributed() else (0, 1)


@contextlib.contextmanager
def distributed(device: str) -> Iterator[str]:
    """Under torchrun (WORLD_SIZE > 1): join the process group (nccl on CUDA, one GPU per process, else gloo) for the
    duration and yield this process's device; otherwise yield `device` unchanged."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        yield device
        return
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    try:
        yield device
    finally:
        torch.distributed.destroy_process_group()


def rank_share(count: int, batch_size: int, rank: int, world: int) -> List[int]:
    """The indices of `count` items this rank evaluates: batches of batch_size dealt round-robin to the ranks."""
    return [i for b in range(rank, math.ceil(count / batch_size), world)
            for i in range(b * batch_size, min((b + 1) * batch_size, count))]


def warmup_cosine_lr(step: int, total_steps: int, warmup_steps: int, base_lr: float) -> float:
    """Linear warm-up over warmup_steps, then cosine decay to 0 at total_steps (step counts from 0)."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def epoch_batches(num_images: int, epoch: int, seed: int, batch_size: int, rank: int = 0, world: int = 1) -> List[List[int]]:
    """This rank's batches of one epoch: a (seed, epoch) permutation, split in global batches of
    batch_size * world images, each rank taking its slice; the incomplete last batch is dropped."""
    order = torch.randperm(num_images, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()
    per_step = batch_size * world
    return [order[i + rank * batch_size:i + (rank + 1) * batch_size]
            for i in range(0, num_images - per_step + 1, per_step)]


class SeededAugment(torch.utils.data.Dataset):
    """Random augmentations seeded by (seed, epoch, index), in torch's and Python's generators: the same crops
    whatever the number of processes or the step a run resumed from. Set `epoch` before each pass."""

    def __init__(self, dataset: torch.utils.data.Dataset, seed: int) -> None:
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        seed = (self.seed * 1_000_003 + self.epoch) * 1_000_033 + i
        python_state = random.getstate()  # timm's transforms draw from Python's random, torchvision's from torch
        try:
            random.seed(seed)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                return self.dataset[i]
        finally:
            random.setstate(python_state)


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float, has_head: bool) -> torch.Tensor:
    """KL(teacher || student) on softmax(logits / T) times T^2 for (B, classes) logits, or L1 between (B, D)
    features when has_head is False."""
    if not has_head:
        return F.l1_loss(student.float(), teacher.float())
    t = temperature
    return F.kl_div(F.log_softmax(student.float() / t, -1), F.log_softmax(teacher.float() / t, -1),
                    reduction="batchmean", log_target=True) * t * t


ACCUMULATE = integer("--accumulate", 1, "(batches per optimiser step)")


def stop_after_check(unit: str) -> Callable[[Any], int]:
    """The check of --stop-after-{unit}s: the step (or epoch) to leave after, >= 1."""
    return integer(f"--stop-after-{unit}s", 1)


def check_loop_settings(amp: Optional[bool], amp_dtype: str, accumulate: Any) -> None:
    """Raise ValueError naming the flag for a bad --amp / --amp-dtype / --accumulate."""
    if amp is not None:
        check_bool("--amp", amp)
    check_choice("--amp-dtype", amp_dtype, AMP_DTYPES)
    ACCUMULATE(accumulate)


@dataclass
class Schedule:
    """What a task asks of the loop. batch_size: images per micro-batch and process; an optimiser step takes
    accumulate micro-batches on every process. lr: the peak learning rate. amp None: on for CUDA, off on the CPU."""

    steps: int
    steps_per_epoch: int
    batch_size: int
    lr: float
    weight_decay: float
    warmup_steps: int
    seed: int
    checkpoint_every: int
    accumulate: int = 1
    amp: Optional[bool] = None
    amp_dtype: str = "bfloat16"


class TrainingTask:
    """What a task supplies: `module` (every trainable parameter, requires_grad; its forward is the student's),
    `train_set` (a SeededAugment of (x, y) items), `schedule`, `log_columns` (what loss() returns that is logged
    every step, 'loss' among them), and the methods below. Before the first step the engine sets `forward` (the
    module, DDP-wrapped when distributed; call it for the student) and `autocast` (a context factory; the loss
    already runs inside it)."""

    name = "train"
    module: nn.Module
    train_set: SeededAugment
    schedule: Schedule
    log_columns: Tuple[str, ...] = ("loss",)
    forward: Callable[..., torch.Tensor]
    autocast: Callable[[], ContextManager]

    def loss(self, batch: Sequence[torch.Tensor], step: int) -> Dict[str, Any]:
        """{'loss': scalar tensor (mean over the batch), and a number per log column} for one micro-batch."""
        raise NotImplementedError

    def evaluate(self, epoch: int) -> Optional[Dict[str, Optional[float]]]:
        """Metrics after each epoch (logged to log.csv; every rank calls it), or None for tasks that do not."""
        return None

    def finish(self, out: Path, writer: bool, seconds: float) -> Any:
        """After the last step, the parameters finite: save the result into `out` (writer: this rank writes), return
        what the caller gets. seconds: the training time, resumed runs included. Every rank calls it."""
        raise NotImplementedError

    def interrupted(self) -> Any:
        """What the caller gets when the run stops early (stop_after)."""
        return None

    def close(self) -> None:
        """Undo what the task did to models it was given; called however the run ends."""


def train(make_task: Callable[[str, int], TrainingTask], out: str, run_entries: Sequence[str], settings: Dict[str, Any],
          run: Dict[str, Any], resume: bool = False, overwrite: bool = False, device: str = "cpu",
          show_progress: bool = True, num_workers: int = 2, stop_after: Optional[int] = None, stop_unit: str = "step",
          seed: int = 0, old_settings: Optional[Dict[str, Any]] = None) -> Any:
    """Claim `out` (a non-empty folder is refused unless resume or overwrite; outputs.run_folder), seed torch with
    `seed` (the same initial parameters in every process; the caller's generators are restored afterwards), build
    the task with make_task(device, world size), train it, and return task.finish(...); or task.interrupted() after
    stop_after steps (epochs with stop_unit 'epoch'), leaving a checkpoint that resume continues. Under
    torch.distributed every rank calls this with the same arguments; rank 0 writes.

    settings (the recipe) and run (what it trains on: the model's name and the identities of its weights and data,
    timm_tokcomp.files.identity) are what a resumed run must share: with resume, the checkpoint is checked against them
    before make_task does any work. old_settings: settings added since a checkpoint may have been written, at the
    value such a checkpoint ran with."""
    if stop_after is not None:
        stop_after_check(stop_unit)(stop_after)
    rank, world = rank_and_world()
    dev = torch.device(device)
    forked = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    # the caller's random streams are left as they were: the run draws from its own, seeded ones
    with run_folder(out, resume, overwrite, run_entries, writer=rank == 0), torch.random.fork_rng(devices=forked):
        state = _checkpoint_to_resume(Path(out) / "training" / CHECKPOINT, settings, run, old_settings or {}, world,
                                      rank) if resume else None
        torch.manual_seed(seed)
        task = make_task(device, world)
        try:
            return _Loop(task, Path(out), device, rank, world, show_progress, num_workers, settings, run).run(
                state, stop_after, stop_unit)
        finally:
            task.close()


def _checkpoint_to_resume(path: Path, settings: Dict[str, Any], run: Dict[str, Any], old_settings: Dict[str, Any],
                          world: int, rank: int) -> Optional[Dict[str, Any]]:
    """The checkpoint at path, or None (a note) where there is none yet; ValueError when it was written by another
    format, with other settings or on other inputs."""
    if not path.is_file():
        if rank == 0:
            print(f"note: --resume: no {path} yet, starting from step 0", file=sys.stderr)
        return None
    state = read_torch(path, "--resume")  # on the CPU: load_state_dict copies to the parameters' devices
    if not isinstance(state, dict):
        raise ValueError(f"--resume: {path} holds a {type(state).__name__}, not a timm_tokcomp training checkpoint")
    if "format" not in state:
        raise ValueError(f"--resume: {path} was written by timm_tokcomp 0.1.0's trainer (checkpoint format 1; "
                         f"this is {__version__}, format {CHECKPOINT_FORMAT}): finish it with 0.1.0, or start "
                         f"again in a new --out")
    if not is_version(state["format"], CHECKPOINT_FORMAT):
        raise ValueError(f"--resume: {path} was written by timm_tokcomp {state.get('version')} (checkpoint format "
                         f"{state['format']}; this is {__version__}, format {CHECKPOINT_FORMAT}): resume it with "
                         f"that version, or start again in a new --out")
    saved = {**old_settings, **state["config"]}
    if saved != settings or state["world_size"] != world:
        changed = sorted(k for k in {*saved, *settings} if saved.get(k) != settings.get(k))
        if state["world_size"] != world:
            changed.append(f"processes={state['world_size']}")
        raise ValueError(f"--resume: {path} was written with other settings ("
                         f"{', '.join(c if '=' in c else f'{c}={saved.get(c)!r}' for c in changed)}); give the "
                         f"same ones or a new --out")
    if state["run"] != run:
        changed = sorted(k for k in {*run, *state["run"]} if state["run"].get(k) != run.get(k))
        was = ", ".join(f"{k}={state['run'].get(k)!r}" for k in changed)
        raise ValueError(f"--resume: {path} was written for another {', '.join(changed)} ({was}; now "
                         f"{', '.join(f'{k}={run.get(k)!r}' for k in changed)}); give the same or a new --out")
    return state


class _Loop:
    def __init__(self, task: TrainingTask, out: Path, device: str, rank: int, world: int, show_progress: bool,
                 num_workers: int, settings: Dict[str, Any], run_inputs: Dict[str, Any]) -> None:
        s = task.schedule
        check_loop_settings(s.amp, s.amp_dtype, s.accumulate)
        self.task, self.out, self.device, self.rank, self.world = task, out, device, rank, world
        self.settings, self.run_inputs = settings, run_inputs  # what the checkpoints record
        self.show_progress, self.num_workers = show_progress, num_workers
        self.work = out / "training"
        kind = torch.device(device).type
        use_amp = kind == "cuda" if s.amp is None else s.amp
        dtype = AMP_DTYPES[s.amp_dtype]
        if use_amp and dtype == torch.float16 and kind != "cuda":
            raise ValueError("--amp-dtype float16 needs a CUDA --device (autocast on the CPU runs bfloat16)")
        task.autocast = (lambda: torch.autocast(kind, dtype=dtype)) if use_amp else contextlib.nullcontext
        self.scaler = torch.amp.GradScaler(kind, enabled=use_amp and dtype == torch.float16)
        self.trainable = {name: p for name, p in task.module.named_parameters() if p.requires_grad}
        task.forward = task.module
        if world > 1:
            task.forward = nn.parallel.DistributedDataParallel(
                task.module, device_ids=[device] if kind == "cuda" else None)
        self.optimizer = torch.optim.AdamW(self.trainable.values(), lr=s.lr, weight_decay=s.weight_decay)
        self.step, self.seconds, self.saved = 0, 0.0, 0
        self.log: List[str] = []
        self.epoch_log: List[str] = []

    # checkpoint and resume

    def _resume(self, state: Dict[str, Any]) -> None:
        """Continue from a checkpoint _checkpoint_to_resume accepted."""
        with torch.no_grad():
            for name, p in self.trainable.items():
                p.copy_(state["trainable"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.step = self.saved = state["step"]
        self.log, self.epoch_log, self.seconds = list(state["log"]), list(state["epoch_log"]), state["seconds"]

    def _kept(self) -> str:
        return f"the checkpoint of step {self.saved} is intact" if self.saved else "no checkpoint had been written"

    def _check_finite(self) -> None:
        if not all(torch.isfinite(p).all() for p in self.trainable.values()):
            raise TrainingDiverged(f"training diverged: the trained parameters are not finite after step {self.step}; "
                                   f"nothing of it is saved ({self._kept()}). Lower --lr.")

    def _save(self, seconds: float) -> None:
        self._check_finite()
        if self.rank == 0:
            with replacing(self.work / CHECKPOINT) as tmp:
                torch.save({"format": CHECKPOINT_FORMAT, "version": __version__, "step": self.step,
                            "trainable": {k: p.detach().cpu() for k, p in self.trainable.items()},
                            "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
                            "config": self.settings, "run": self.run_inputs, "world_size": self.world,
                            "log": list(self.log), "epoch_log": list(self.epoch_log), "seconds": seconds}, tmp)
        self.saved = self.step

    # the loop

    def run(self, state: Optional[Dict[str, Any]], stop_after: Optional[int], stop_unit: str) -> Any:
        """Train from step 0, or from checkpoint `state`, to the end or to stop_after."""
        task, s = self.task, self.task.schedule
        if state is not None:
            self._resume(state)
        last = s.steps if stop_after is None else \
            min(s.steps, stop_after * (s.steps_per_epoch if stop_unit == "epoch" else 1))
        step_header = ",".join(["step", *task.log_columns, "lr", "seconds"])
        step_log = self.work / STEP_LOG
        if self.rank == 0:
            write_text(step_log, "\n".join([step_header, *self.log]) + "\n")
        began = time.time() - self.seconds
        bar = tqdm(total=last, initial=self.step, desc=task.name, disable=not self.show_progress or self.rank != 0,
                   file=sys.stderr)
        ema = None
        task.module.train()
        while self.step < last:
            epoch, skip = divmod(self.step, s.steps_per_epoch)
            per_step = s.batch_size * s.accumulate
            batches = epoch_batches(len(task.train_set), epoch, s.seed, per_step, self.rank, self.world)
            batches = [b[i:i + s.batch_size] for b in batches[skip:skip + last - self.step]
                       for i in range(0, per_step, s.batch_size)]
            task.train_set.epoch = epoch
            loader = torch.utils.data.DataLoader(task.train_set, batch_sampler=batches, num_workers=self.num_workers)
            micro: List[Sequence[torch.Tensor]] = []
            for batch in loader:
                micro.append([t.to(self.device, non_blocking=True) for t in batch])
                if len(micro) < s.accumulate:
                    continue
                values = self._optimizer_step(micro)
                micro = []
                self.step += 1
                ema = values["loss"] if ema is None else 0.98 * ema + 0.02 * values["loss"]
                row = ",".join([str(self.step), *(_cell(values[c]) for c in task.log_columns),
                                f"{values['lr']:.6g}", f"{time.time() - began:.1f}"])
                self.log.append(row)
                if self.rank == 0:
                    with open(step_log, "a") as f:
                        f.write(row + "\n")
                    bar.set_postfix_str(f"epoch {epoch + 1} loss {ema:.4f}", refresh=False)
                    bar.update(1)
                if self.step % s.steps_per_epoch == 0:
                    self._end_epoch(epoch, began, bar)
                if self.step % s.checkpoint_every == 0 or self.step == last:
                    self._save(time.time() - began)
        bar.close()
        if self.step < s.steps:
            return task.interrupted()
        # the parameters are finite: _save checked them at the last step (or before writing the checkpoint resumed)
        result = task.finish(self.out, self.rank == 0, time.time() - began)
        if self.world > 1:
            torch.distributed.barrier()
        return result

    def _optimizer_step(self, micro: List[Sequence[torch.Tensor]]) -> Dict[str, Any]:
        """One optimiser step over the micro-batches; returns the step's mean loss and logged values and the lr."""
        task, s = self.task, self.task.schedule
        lr = warmup_cosine_lr(self.step, s.steps, s.warmup_steps, s.lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        total, values = 0.0, {}
        for i, batch in enumerate(micro):
            sync = i == len(micro) - 1 or self.world == 1  # DDP averages the gradients once, after the last
            with contextlib.nullcontext() if sync else task.forward.no_sync():
                with task.autocast():
                    values = task.loss(batch, self.step)
                value = self._mean_over_ranks(values["loss"])
                if not math.isfinite(value):  # the same value on every rank: all stop together
                    raise TrainingDiverged(f"training diverged: the loss is {value} at step {self.step + 1}; nothing "
                                           f"of it is saved ({self._kept()}). Lower --lr.")
                self.scaler.scale(values["loss"] / len(micro)).backward()
            total += value
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return {**values, "loss": total / len(micro), "lr": lr}

    def _mean_over_ranks(self, loss: torch.Tensor) -> float:
        """The loss averaged over the processes' micro-batches (the global batch's loss)."""
        if self.world == 1:
            return loss.item()
        mean = loss.detach().float().clone()
        torch.distributed.all_reduce(mean)
        return mean.item() / self.world

    def _end_epoch(self, epoch: int, began: float, bar: tqdm) -> None:
        metrics = self.task.evaluate(epoch)
        self.task.module.train()
        if metrics is None:
            return
        steps = self.log[-self.task.schedule.steps_per_epoch:]
        column = 1 + self.task.log_columns.index("loss")
        train_loss = sum(float(row.split(",")[column]) for row in steps) / len(steps)
        lr = steps[-1].split(",")[-2]
        self.epoch_log.append(",".join([str(epoch + 1), f"{train_loss:.5f}", *(_cell(v, 2) for v in metrics.values()),
                                        lr, f"{time.time() - began:.1f}"]))
        if self.rank == 0:
            header = ",".join(["epoch", "train_loss", *metrics, "last_lr", "seconds"])
            write_text(self.work / EPOCH_LOG, "\n".join([header, *self.epoch_log]) + "\n")
            shown = ", ".join(f"{k.replace('_', ' ')} {v:.2f}%" for k, v in metrics.items() if v is not None)
            bar.write(f"epoch {epoch + 1}/{math.ceil(self.task.schedule.steps / self.task.schedule.steps_per_epoch)}: "
                      f"train loss {train_loss:.4f}" + (f", {shown}" if shown else ""), file=sys.stderr)


def _cell(value: Any, digits: int = 6) -> str:
    """A log cell: '' for None, integers as they are, other numbers with `digits` decimals."""
    if value is None:
        return ""
    if is_int(value):
        return str(int(value))
    return f"{float(value):.{digits}f}" if is_real(value) else str(value)
