"""Parameter-efficient fine-tuning of a token-reducing timm ViT (PYRA's recipe): LoRA via peft on every block's
qkv, a new classification head, and the method's own parameters (PYRA's, PatchMerger's), trained with AdamW
and a warm-up + cosine schedule on a labelled image folder, evaluated every epoch. With `distill` the labels
are not used: the model keeps its head and learns the unreduced model's outputs (KL at temperature 1) on any
image folder, and the evaluation reports agreement with the unreduced model (and top-1 where there are labels).

The result is one folder, loadable with load_finetuned from a local path or the Hugging Face Hub:
  adapter_config.json, adapter_model.safetensors   a standard peft LoRA adapter (LoRA on qkv + the head; none
                                                   with lora_rank 0)
  <method>.safetensors, <method>_config.json       the method's learned parameters (if it has any)
  tokcomp_finetune.json                            base model, method, classes, recipe, results (written last)
  README.md                                        a model card
  training/                                        checkpoint.pt (resume), log.csv (per epoch), loss_log.csv
                                                   (per step), predictions.csv
FinetuneTask is the task the training engine (training.engine) runs; the folder's reading and writing is in
training.folder, the recipe in training.recipe.
"""
import contextlib
import copy
import csv
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from ..core import apply, get_reducer
from ..methods import method_class
from ..utils.extras import require
from ..files.identity import data_digest, weights_digest
from ..measure.agreement import compare
from ..deployment.specs import MethodItem
from ..files.data import check_num_classes, open_dataset, open_images
from ..models.build import build_base_model, eval_transform
from ..files.outputs import replacing
from ..patch import adapter_skip
from .engine import SeededAugment, Schedule, TrainingTask, distill_loss, rank_and_world, rank_share, train
from .folder import RUN_ENTRIES, finish_folder, load_finetuned, lora_config, save_folder
from .recipe import FinetuneConfig, FinetuneResult

__all__ = ["FinetuneConfig", "FinetuneResult", "FinetuneTask", "finetune", "load_finetuned", "predict"]


def _transforms(model: nn.Module, config: FinetuneConfig):
    import timm

    data_config = timm.data.resolve_model_data_config(model)
    evaluation = eval_transform(model)
    if config.augment == "none":
        return evaluation, evaluation
    train = timm.data.create_transform(
        input_size=data_config["input_size"], is_training=True, scale=config.crop_scale, hflip=0.5, color_jitter=None,
        interpolation=data_config["interpolation"], mean=data_config["mean"], std=data_config["std"])
    return train, evaluation


@torch.no_grad()
def predict(model: nn.Module, loader, device: str, show_progress: bool, desc: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(labels, predicted classes) of every image of the loader, in order."""
    was_training = model.training
    model.eval()
    labels, preds = [], []
    for x, y in tqdm(loader, desc=desc, disable=not show_progress, file=sys.stderr, leave=False):
        preds.append(model(x.to(device)).argmax(dim=-1).cpu())
        labels.append(y)
    model.train(was_training)
    return torch.cat(labels), torch.cat(preds)


def _scores(labels: torch.Tensor, pred: torch.Tensor, reference: Optional[torch.Tensor]):
    """(top-1 %, None when no image has a label (-1); agreement % with the reference predictions, or None)."""
    paired = compare(pred, pred if reference is None else reference, labels)
    return paired.top1, None if reference is None else paired.agreement


class FinetuneTask(TrainingTask):
    """LoRA (peft) on every block's qkv, a new head (or, distilling, the model's own) and the method's parameters,
    trained on cross-entropy with the labels or KL to the unreduced model, plus the method's own loss; evaluated
    after every epoch (top-1, agreement with the unreduced model); at the end rank 0 saves the folder, reloads it
    and evaluates it."""

    def __init__(self, model: nn.Module, base_model: str, train_data: str, eval_data: str, config: FinetuneConfig,
                 method: Optional[MethodItem], checkpoint: Optional[str], pretrained: bool, device: str, world: int,
                 show_progress: bool, num_workers: int) -> None:
        get_peft_model = require("peft", "train", "tokcomp finetune's LoRA").get_peft_model
        self.name = f"fine-tune {config.method}"
        self.config, self.base_model, self.device, self.world = config, base_model, device, world
        self.checkpoint, self.pretrained, self.show_progress = checkpoint, pretrained, show_progress
        self.train_data, self.eval_data, self.num_workers = train_data, eval_data, num_workers
        self.method = method  # the config's, parsed once (FinetuneConfig.validate)
        train_tf, eval_tf = _transforms(model, config)
        eval_flag = "--data" if eval_data == train_data else "--eval-data"
        if config.distill:
            if not getattr(model, "num_classes", 0):
                raise ValueError("--distill learns the unreduced model's class outputs; this model has no head")
            train_set, self.eval_set = open_images(train_data, train_tf), open_images(eval_data, eval_tf, eval_flag)
            self.num_classes = model.num_classes
            self.teacher = copy.deepcopy(model).to(device).eval().requires_grad_(False)  # the unreduced model
        else:
            train_set, self.eval_set = open_dataset(train_data, train_tf), open_dataset(eval_data, eval_tf, eval_flag)
            self.num_classes = max(train_set.labels) + 1
            check_num_classes(self.eval_set, self.num_classes, eval_flag)  # the classes of --data
            model.reset_classifier(self.num_classes)
            self.teacher = None
        per_step = config.batch_size * world * config.accumulate
        if len(train_set) < per_step:
            raise ValueError(f"--data has {len(train_set)} images, fewer than one global batch (--batch-size "
                             f"{config.batch_size} x {world} processes x --accumulate {config.accumulate})")
        if self.method is not None:
            apply(model, self.method.method, **self.method.params)
        skip = adapter_skip(model) if config.lora_rank else None
        if skip is not None:
            raise ValueError(f"--method none with --lora-rank {config.lora_rank}: {skip}")
        model.name_or_path = base_model  # what peft records as the adapter's base_model_name_or_path
        if config.lora_rank:
            self.module = get_peft_model(model, lora_config(config, model, base_model))
        else:  # the backbone stays frozen: only the method's parameters train
            self.module = model.requires_grad_(False)
        self.learned = getattr(model, "tokcomp", None)
        if self.learned is not None:
            self.learned.requires_grad_(True)  # peft freezes everything it does not own
        self.module.to(device)
        self.model = model
        self.train_set = SeededAugment(train_set, config.seed)
        steps_per_epoch = len(train_set) // per_step
        self.schedule = Schedule(
            steps=config.epochs * steps_per_epoch, steps_per_epoch=steps_per_epoch, batch_size=config.batch_size,
            lr=config.lr, weight_decay=config.weight_decay, warmup_steps=config.warmup_epochs * steps_per_epoch,
            seed=config.seed, checkpoint_every=steps_per_epoch, accumulate=config.accumulate, amp=config.amp,
            amp_dtype=config.amp_dtype)
        self.autocast = contextlib.nullcontext
        self.reference = None if self.teacher is None else \
            self._predict(self.teacher, "evaluate the unreduced model")[1]

    def _predict(self, model: nn.Module, desc: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """(labels, predictions) of every evaluation image; each rank predicts its share, every rank gets all."""
        rank, world = rank_and_world()
        mine = rank_share(len(self.eval_set), self.config.eval_batch_size, rank, world)
        loader = torch.utils.data.DataLoader(torch.utils.data.Subset(self.eval_set, mine), num_workers=self.num_workers,
                                             batch_size=self.config.eval_batch_size)
        with self.autocast():
            labels, preds = predict(model, loader, self.device, self.show_progress and rank == 0, desc)
        if world == 1:
            return labels, preds
        shares = [None] * world
        torch.distributed.all_gather_object(shares, (mine, labels, preds))
        order = torch.tensor([i for share in shares for i in share[0]]).argsort()
        return (torch.cat([share[1] for share in shares])[order], torch.cat([share[2] for share in shares])[order])

    def loss(self, batch, step):
        x, y = batch
        if self.teacher is None:
            loss = F.cross_entropy(self.forward(x), y)
        else:
            with torch.no_grad():
                target = self.teacher(x)
            loss = distill_loss(self.forward(x), target, 1.0, True)
        method_loss = None if self.method is None else get_reducer(self.model).method_loss()
        return {"loss": loss if method_loss is None else loss + method_loss}

    def evaluate(self, epoch):
        top1, agreement = _scores(*self._predict(self.module, f"evaluate epoch {epoch + 1}"), self.reference)
        return {"eval_top1": top1, "eval_agreement": agreement}

    def finish(self, out: Path, writer: bool, seconds: float) -> Optional[FinetuneResult]:
        if not writer:
            return None
        saved = save_folder(self.module, self.model, str(out), self.base_model, self.num_classes, self.config,
                            self.method)
        trainable = sum(p.numel() for p in self.module.parameters() if p.requires_grad)
        method_parameters = 0 if self.learned is None else sum(p.numel() for p in self.learned.parameters())
        result = _final_evaluation(out, self, seconds, trainable, method_parameters)
        finish_folder(str(out), saved, self.base_model, self.eval_data, self.train_data, len(self.train_set),
                      self.config, result)
        return result


def refuse_in_place_training(model: nn.Module, method: str, params: dict) -> None:
    """ValueError where `method` with `params` would train with in-place soft steps on a model with rotary
    positions (see rope.TokenPositions.reduced), naming the method and what runs instead."""
    if getattr(model, "rope", None) is not None and method_class(method).trains_in_place(params):
        raise ValueError(f"{method} trains with every token in place and soft sizes, which defines no rotary "
                         f"position for a merged token; {type(model).__name__} has rotary embeddings. Train {method} "
                         "on a model without them (its eval model runs on this one)")


def finetune(base_model: str, train_data: str, out: str, eval_data: Optional[str] = None,
             config: FinetuneConfig = FinetuneConfig(), checkpoint: Optional[str] = None, pretrained: bool = False,
             resume: bool = False, overwrite: bool = False, device: str = "cpu", show_progress: bool = True,
             num_workers: int = 2, stop_after_epoch: Optional[int] = None) -> Optional[FinetuneResult]:
    """Fine-tune timm model `base_model` (weights from `checkpoint` or timm's `pretrained`) with config.method
    on the labelled images of train_data (a labels.csv folder, a labels .csv file, or an ImageFolder tree),
    evaluating on eval_data after every epoch, and save the folder described in the module docstring to `out`,
    through the training engine (training.engine.train: run folder and lock, resume from
    out/training/checkpoint.pt, DDP under torch.distributed with rank 0 writing, AMP, divergence checks).
    Seeded: the same config gives the same run. stop_after_epoch: leave after that epoch with a checkpoint;
    returns None then (and on ranks other than 0), else the final evaluation."""
    method = config.validate()
    require("peft", "train", "tokcomp finetune")  # before any work
    eval_data = eval_data or train_data
    # without weights, the same random ones every call (a resume needs them)
    model = build_base_model(base_model, checkpoint, pretrained, "cpu", seed=config.seed, trains="tokcomp finetune")
    if method is not None:  # before the run folder is made
        refuse_in_place_training(model, method.method, method.params)
    train_digest = data_digest(train_data, "--data")
    run = {"base_model": base_model, "weights_sha256": weights_digest(model), "data_sha256": train_digest,
           "eval_data_sha256": train_digest if eval_data == train_data else data_digest(eval_data, "--eval-data")}
    return train(lambda device, world: FinetuneTask(model, base_model, train_data, eval_data, config, method,
                                                    checkpoint, pretrained, device, world, show_progress, num_workers),
                 out, RUN_ENTRIES, asdict(config), run, resume=resume, overwrite=overwrite, device=device,
                 show_progress=show_progress, num_workers=num_workers, stop_after=stop_after_epoch, stop_unit="epoch",
                 seed=config.seed)


def _final_evaluation(out: Path, task: FinetuneTask, train_seconds: float, trainable_parameters: int,
                      method_parameters: int) -> FinetuneResult:
    """Reload the saved folder (LoRA merged), then top-1 (and agreement with the reference predictions),
    per-image predictions, MACs counted from a run and forward throughput on the evaluation images (in fp32, in
    this process only)."""
    from ..measure.counting import count_macs
    from ..measure.timing import time_side_by_side

    config, eval_set, reference, device = task.config, task.eval_set, task.reference, task.device
    model = load_finetuned(str(out), checkpoint=task.checkpoint, pretrained=task.pretrained, device=device)
    loader = torch.utils.data.DataLoader(eval_set, batch_size=config.eval_batch_size, num_workers=task.num_workers)
    y, pred = predict(model, loader, device, task.show_progress, "evaluate the saved model")
    columns = [eval_set.names, y.tolist(), pred.tolist()] + ([] if reference is None else [reference.tolist()])
    with replacing(out / "training" / "predictions.csv") as tmp, open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["file", "label", "prediction"] + ([] if reference is None else ["unreduced_prediction"]))
        writer.writerows(zip(*columns))
    x = torch.stack([eval_set[i][0] for i in range(min(config.eval_batch_size, len(eval_set)))]).to(device)
    macs = count_macs(model, x) / len(x)
    with torch.inference_mode():
        seconds = time_side_by_side({"model": model}, x, rounds=3)["model"]
    top1, agreement = _scores(y, pred, reference)
    return FinetuneResult(top1=top1, images=len(y), gmacs=macs / 1e9, images_per_second=len(x) / seconds,
                          train_seconds=train_seconds, epochs=config.epochs, trainable_parameters=trainable_parameters,
                          method_parameters=method_parameters, agreement=agreement)
