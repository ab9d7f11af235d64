"""Pieces every trainer shares: the learning-rate schedule, seeded epoch batches and augmentations, and
the distributed-run helpers, the distillation loss. ToCom's self-distillation and the fine-tuning both use them."""
import math
import random
from typing import List

import torch
import torch.nn.functional as F


class TrainingDiverged(RuntimeError):
    """The loss or the trained parameters became non-finite; nothing non-finite was saved."""


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


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
