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
  training/                                        checkpoint.pt (resume), log.csv, predictions.csv
"""
import copy
import csv
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from .. import apply, get_reducer
from ..data import check_num_classes, open_dataset, open_images
from ..learned import load_learned, save_learned
from ..methods import make_reducer, method_class, parse_method_tag
from ..outputs import replacing, run_folder, write_text
from ..schedules import is_int
from ..userfiles import check_safetensors, hub_snapshot, read_json, read_torch, read_versioned_json
from .card import model_card
from .engine import SeededAugment, TrainingDiverged, distill_loss, epoch_batches, warmup_cosine_lr

FORMAT_VERSION = 1
FINETUNE_CONFIG = "tokcomp_finetune.json"
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
RUN_ENTRIES = (*PEFT_FILES, FINETUNE_CONFIG, "README.md", "*.safetensors", "*_config.json", "training")
NO_METHOD = "none"
LOG_HEADER = "epoch,train_loss,eval_top1,eval_agreement,last_lr,seconds"
AUGMENTS = ("crop-flip", "none")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class FinetuneConfig:
    """The recipe. method: a method tag ('tome_high', 'pyra_high', 'pyra_r16', 'evit_r8', ...) or 'none';
    method_args: more method parameters (e.g. {'form': 'pooled'}); lr is per batch of batch_size images (no
    scaling; 3e-3 beat PYRA's 1e-3 for 8-epoch runs, chosen on Caltech-101's train / val lists); lora_alpha None = lora_rank (LoRA scaling 1); augment 'crop-flip': random resized crops of
    crop_scale of the area and horizontal flips, 'none': the model's eval transform; distill: learn the unreduced
    model's outputs instead of labels (the head is kept, not replaced)."""

    method: str = NO_METHOD
    method_args: Dict[str, Any] = field(default_factory=dict)
    epochs: int = 10
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 1e-4
    warmup_epochs: int = 1
    lora_rank: int = 8  # 0: no LoRA, only the method's parameters train (with distill)
    lora_alpha: Optional[float] = None
    augment: str = "crop-flip"
    crop_scale: Tuple[float, float] = (0.5, 1.0)
    seed: int = 0
    eval_batch_size: int = 64
    distill: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the command-line flag of the first bad setting, before any work."""
        for name in ("epochs", "batch_size", "eval_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{_flag(name)} must be an integer >= 1, got {value!r}")
        for name in ("seed", "warmup_epochs", "lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{_flag(name)} must be an integer >= 0, got {value!r}")
        if self.warmup_epochs >= self.epochs:
            raise ValueError(f"--warmup-epochs must be in [0, epochs={self.epochs}), got {self.warmup_epochs}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr!r}")
        if not (isinstance(self.weight_decay, (int, float)) and math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay!r}")
        if self.lora_alpha is not None and not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ValueError(f"--lora-alpha must be a finite number > 0, got {self.lora_alpha!r}")
        if not isinstance(self.distill, bool):
            raise ValueError(f"--distill must be True or False, got {self.distill!r}")
        if self.augment not in AUGMENTS:
            raise ValueError(f"--augment must be one of {AUGMENTS}, got {self.augment!r}")
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"--crop-min must be in (0, 1], got crop_scale {self.crop_scale}")
        method = self.method_params()  # raises for an unknown tag or parameter
        if self.lora_rank == 0 and not (self.distill and method is not None
                                        and getattr(method_class(method[0]), "learned_param", None)):
            raise ValueError("--lora-rank 0 (no LoRA: only the method's parameters train) needs --distill and a method "
                             "with learned parameters (pyra, patchmerger, sinkhorn, sit, dynamicvit)")
        if method is not None:
            try:  # a bad value (e.g. form='wide') fails here, before --overwrite deletes an earlier run
                make_reducer(method[0], **method[1])
            except (TypeError, ValueError) as e:
                raise ValueError(f"--method-arg: {e}") from None

    def method_params(self) -> Optional[Tuple[str, Dict[str, Any]]]:
        """(method, parameters) from the tag and method_args; None for 'none'."""
        if self.method == NO_METHOD:
            if self.method_args:
                raise ValueError(f"--method-arg needs a --method; got {self.method_args} with --method none")
            return None
        try:
            name, params = parse_method_tag(self.method)
        except ValueError as e:
            raise ValueError(f"--method: {e}; or '{NO_METHOD}'") from None
        learned = getattr(method_class(name), "learned_param", None)
        if learned in self.method_args:
            raise ValueError(f"--method-arg {learned} cannot be given: the method's parameters are trained here")
        valid = method_class(name).param_names()
        unknown = sorted(set(self.method_args) - set(valid))
        if unknown:
            raise ValueError(f"--method-arg: unknown parameter(s) {unknown} for {name}; valid: {list(valid)}")
        return name, {**params, **self.method_args}


@dataclass
class FinetuneResult:
    """The final evaluation of the saved (reloaded, LoRA merged) model on the evaluation images: top-1 (None when
    they have no labels) and, for a distilled model, agreement with the unreduced model's top-1 class."""

    top1: Optional[float]
    images: int
    gmacs: float
    images_per_second: float
    train_seconds: float
    epochs: int
    trainable_parameters: int
    method_parameters: int  # of them, the method's own (PYRA's); 0 for a training-free method
    agreement: Optional[float] = None


def dataset_labels(dataset: torch.utils.data.Dataset) -> List[int]:
    """Class index of every image of a dataset open_dataset made (labels.csv or ImageFolder)."""
    return dataset.labels


def _transforms(model: nn.Module, config: FinetuneConfig):
    import timm

    data_config = timm.data.resolve_model_data_config(model)
    evaluation = timm.data.create_transform(**data_config)
    if config.augment == "none":
        return evaluation, evaluation
    train = timm.data.create_transform(
        input_size=data_config["input_size"], is_training=True, scale=config.crop_scale, hflip=0.5, color_jitter=None,
        interpolation=data_config["interpolation"], mean=data_config["mean"], std=data_config["std"])
    return train, evaluation


def _lora_config(config: FinetuneConfig, model: nn.Module, base_model: str):
    from peft import LoraConfig

    heads = [] if config.distill else [name for name in ("head", "head_dist") if isinstance(getattr(model, name, None), nn.Linear)]
    return LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha or config.lora_rank, target_modules=["qkv"],
                      lora_dropout=0.0, modules_to_save=heads, base_model_name_or_path=base_model)


def _trainable(model: nn.Module) -> Dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


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


def _read_checkpoint(path: Path, config: FinetuneConfig, run: Dict[str, Any], trainable: Dict[str, nn.Parameter],
                     optimizer: torch.optim.Optimizer) -> Tuple[int, List[str], float]:
    state = read_torch(path, "--resume")
    if {"distill": False, **state["config"]} != asdict(config):  # checkpoints from before distill did not distil
        raise ValueError(f"--resume: {path} was written with other settings ({state['config']}); give the same "
                         f"ones or a new --out")
    saved = state.get("run", run)  # checkpoints from before the run identity was kept carry none
    if saved != run:
        changed = sorted(k for k in run if saved.get(k) != run[k])
        was = ", ".join(f"{k}={saved.get(k)!r}" for k in changed)
        raise ValueError(f"--resume: {path} was written for another {', '.join(changed)} ({was}); give the same "
                         f"or a new --out")
    with torch.no_grad():
        for name, p in trainable.items():
            p.copy_(state["trainable"][name])
    optimizer.load_state_dict(state["optimizer"])
    log = [line if line.count(",") == 5 else _with_empty_agreement(line) for line in state["log"]]
    return state["epoch"], log, state["seconds"]


def _with_empty_agreement(line: str) -> str:
    """A log line of a checkpoint from before the eval_agreement column, in today's columns."""
    cells = line.split(",")
    return ",".join([*cells[:3], "", *cells[3:]])


def finetune(base_model: str, train_data: str, out: str, eval_data: Optional[str] = None,
             config: FinetuneConfig = FinetuneConfig(), checkpoint: Optional[str] = None, pretrained: bool = False,
             resume: bool = False, overwrite: bool = False, device: str = "cpu", show_progress: bool = True,
             num_workers: int = 2, stop_after_epoch: Optional[int] = None) -> Optional[FinetuneResult]:
    """Fine-tune timm model `base_model` (weights from `checkpoint` or timm's `pretrained`) with config.method
    on the labelled images of train_data (a labels.csv folder, a labels .csv file, or an ImageFolder tree),
    evaluating on eval_data after every epoch, and save the folder described in the module docstring to `out`.
    Seeded: the same config gives the same run. A non-empty `out` is refused unless resume (continue from
    out/training/checkpoint.pt, written after every epoch) or overwrite. stop_after_epoch: leave after that
    epoch with a checkpoint (resume continues); returns None then, else the final evaluation. While it runs,
    out/.lock refuses a second process on the same folder."""
    config.validate()
    method = config.method_params()
    if stop_after_epoch is not None and (not is_int(stop_after_epoch) or stop_after_epoch < 1):
        raise ValueError(f"--stop-after must be an integer >= 1 (epochs), got {stop_after_epoch!r}")
    with run_folder(out, resume, overwrite, RUN_ENTRIES):  # an earlier run comes back if this one fails early
        return _finetune(base_model, train_data, out, eval_data or train_data, config, method, checkpoint, pretrained,
                         resume, device, show_progress, num_workers, stop_after_epoch)


def _finetune(base_model, train_data, out, eval_data, config, method, checkpoint, pretrained, resume, device,
              show_progress, num_workers, stop_after_epoch) -> Optional[FinetuneResult]:
    from peft import get_peft_model

    from ..bench import build_base_model

    torch.manual_seed(config.seed)  # the new head, the method's parameters and LoRA's A start from the seed
    model = build_base_model(base_model, checkpoint, pretrained, "cpu")
    train_tf, eval_tf = _transforms(model, config)
    eval_flag = "--data" if eval_data == train_data else "--eval-data"
    if config.distill:
        if not getattr(model, "num_classes", 0):
            raise ValueError("--distill learns the unreduced model's class outputs; this model has no head")
        train_set, eval_set = open_images(train_data, train_tf), open_images(eval_data, eval_tf, eval_flag)
        num_classes = model.num_classes
        teacher = copy.deepcopy(model).to(device).eval().requires_grad_(False)  # the unreduced model
    else:
        train_set, eval_set = open_dataset(train_data, train_tf), open_dataset(eval_data, eval_tf, eval_flag)
        num_classes = max(dataset_labels(train_set)) + 1
        check_num_classes(eval_set, num_classes, eval_flag)  # the classes of --data
        model.reset_classifier(num_classes)
        teacher = None
    if len(train_set) < config.batch_size:
        raise ValueError(f"--data has {len(train_set)} images, fewer than one batch (--batch-size {config.batch_size})")
    if method is not None:
        apply(model, method[0], **method[1])
    model.name_or_path = base_model  # what peft records as the adapter's base_model_name_or_path
    if config.lora_rank:
        peft_model = get_peft_model(model, _lora_config(config, model, base_model))
    else:  # the backbone stays frozen: only the method's parameters train
        peft_model = model.requires_grad_(False)
    learned = getattr(model, "tokcomp", None)
    if learned is not None:
        learned.requires_grad_(True)  # peft freezes everything it does not own
    peft_model.to(device)
    trainable = _trainable(peft_model)
    optimizer = torch.optim.AdamW(trainable.values(), lr=config.lr, weight_decay=config.weight_decay)
    work = Path(out) / "training"
    checkpoint_path = work / "checkpoint.pt"
    start, log, seconds = 0, [], 0.0
    run = {"base_model": base_model, "data": str(train_data), "eval_data": str(eval_data),
           "checkpoint": str(checkpoint or ""), "pretrained": pretrained}  # what a resumed run must share
    if resume and checkpoint_path.is_file():
        start, log, seconds = _read_checkpoint(checkpoint_path, config, run, trainable, optimizer)
    elif resume:
        print(f"note: --resume: no {checkpoint_path} yet, starting from epoch 0", file=sys.stderr)
    seeded_train = SeededAugment(train_set, config.seed)
    eval_loader = torch.utils.data.DataLoader(eval_set, batch_size=config.eval_batch_size, num_workers=num_workers)
    reference = None if teacher is None else predict(teacher, eval_loader, device, show_progress,
                                                     "evaluate the unreduced model")[1]
    steps_per_epoch = len(train_set) // config.batch_size
    total, warmup = config.epochs * steps_per_epoch, config.warmup_epochs * steps_per_epoch
    last = config.epochs if stop_after_epoch is None else min(stop_after_epoch, config.epochs)
    bar = tqdm(total=last * steps_per_epoch, initial=start * steps_per_epoch, desc=f"fine-tune {config.method}",
               disable=not show_progress, file=sys.stderr)
    began = time.time() - seconds
    for epoch in range(start, last):
        peft_model.train()
        seeded_train.epoch = epoch
        loader = torch.utils.data.DataLoader(seeded_train, num_workers=num_workers, batch_sampler=epoch_batches(
            len(train_set), epoch, config.seed, config.batch_size))
        losses = []
        for i, (x, y) in enumerate(loader):
            lr = warmup_cosine_lr(epoch * steps_per_epoch + i, total, warmup, config.lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x = x.to(device)
            if teacher is None:
                loss = F.cross_entropy(peft_model(x), y.to(device))
            else:
                with torch.no_grad():
                    target = teacher(x)
                loss = distill_loss(peft_model(x), target, 1.0, True)
            method_loss = None if method is None else get_reducer(model).method_loss()
            if method_loss is not None:
                loss = loss + method_loss
            if not math.isfinite(loss.item()):
                raise TrainingDiverged(f"training diverged: the loss is {loss.item()} in epoch {epoch + 1}; nothing of this "
                                   f"epoch is saved. Lower --lr.")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            bar.set_postfix_str(f"epoch {epoch + 1} loss {sum(losses[-20:]) / len(losses[-20:]):.3f}", refresh=False)
            bar.update(1)
        y, pred = predict(peft_model, eval_loader, device, show_progress, f"evaluate epoch {epoch + 1}")
        top1, agreement = _scores(y, pred, reference)
        shown = {"top1": top1, "agreement": agreement}
        log.append(f"{epoch + 1},{sum(losses) / len(losses):.5f},{_cell(top1)},{_cell(agreement)},{lr:.6g},"
                   f"{time.time() - began:.1f}")
        write_text(work / "log.csv", "\n".join([LOG_HEADER, *log]) + "\n")
        bar.write(f"epoch {epoch + 1}/{config.epochs}: train loss {sum(losses) / len(losses):.4f}, " + ", ".join(
            f"eval {k} {v:.2f}%" for k, v in shown.items() if v is not None), file=sys.stderr)
        with replacing(checkpoint_path) as tmp:
            torch.save({"epoch": epoch + 1, "trainable": {k: p.detach().cpu() for k, p in trainable.items()},
                        "optimizer": optimizer.state_dict(), "config": asdict(config), "run": run, "log": log,
                        "seconds": time.time() - began}, tmp)
    bar.close()
    if last < config.epochs:
        return None
    train_seconds = time.time() - began
    saved = _save_folder(peft_model, model, out, base_model, num_classes, config)
    method_parameters = 0 if learned is None else sum(p.numel() for p in learned.parameters())
    result = _final_evaluation(out, checkpoint, pretrained, eval_set, eval_loader, reference, device, show_progress,
                               train_seconds, config, sum(p.numel() for p in trainable.values()), method_parameters)
    _finish_folder(out, saved, base_model, eval_data, train_data, len(train_set), config, result)
    return result


def _scores(labels: torch.Tensor, pred: torch.Tensor, reference: Optional[torch.Tensor]):
    """(top-1 %, None when no image has a label (-1); agreement % with the reference predictions, or None)."""
    labelled = labels >= 0
    top1 = 100.0 * (pred[labelled] == labels[labelled]).float().mean().item() if labelled.any() else None
    agreement = None if reference is None else 100.0 * (pred == reference).float().mean().item()
    return top1, agreement


def _cell(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.2f}"


def _save_folder(peft_model, model: nn.Module, out: str, base_model: str, num_classes: int,
                 config: FinetuneConfig) -> Dict[str, Any]:
    """The adapter and the method's parameters; tokcomp_finetune.json (without results) last. Returns what
    that file holds."""
    if config.lora_rank:
        with tempfile.TemporaryDirectory(dir=out, prefix=".peft-") as staging:  # peft writes in place: stage, rename
            peft_model.save_pretrained(staging, save_embedding_layers=False)  # no Hub lookup of the base model
            for name in PEFT_FILES:
                os.replace(Path(staging) / name, Path(out) / name)
    learned = getattr(model, "tokcomp", None)
    method = config.method_params()
    if learned is not None:
        save_learned(learned[method[0]], method[0], out)
    data = {"base_model": base_model, "num_classes": num_classes, "recipe": asdict(config)}
    _write_config(out, data)
    return data


def _write_config(out: str, data: Dict[str, Any]) -> None:
    write_text(Path(out) / FINETUNE_CONFIG, json.dumps({"format_version": FORMAT_VERSION, **data}, indent=2) + "\n")


def _final_evaluation(out, checkpoint, pretrained, eval_set, eval_loader, reference, device, show_progress,
                      train_seconds, config, trainable_parameters, method_parameters) -> FinetuneResult:
    """Reload the saved folder (LoRA merged), then top-1 (and agreement with the reference predictions),
    per-image predictions, MACs counted from a run and forward throughput on the evaluation images."""
    from ..measure import count_macs, time_side_by_side

    model = load_finetuned(out, checkpoint=checkpoint, pretrained=pretrained, device=device)
    y, pred = predict(model, eval_loader, device, show_progress, "evaluate the saved model")
    columns = [eval_set.names, y.tolist(), pred.tolist()] + ([] if reference is None else [reference.tolist()])
    with replacing(Path(out) / "training" / "predictions.csv") as tmp, open(tmp, "w", newline="") as f:
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


def _finish_folder(out: str, saved: Dict[str, Any], base_model: str, eval_data: str, train_data: str,
                   train_images: int, config: FinetuneConfig, result: FinetuneResult) -> None:
    """The model card, then tokcomp_finetune.json (saved: what _save_folder wrote) with the results."""
    data = dict(saved)
    data["results"] = {**asdict(result), "eval_data": str(eval_data), "train_data": str(train_data),
                       "train_images": train_images}
    write_text(Path(out) / "README.md", model_card(base_model, config, result, train_data, eval_data, train_images))
    _write_config(out, data)


def _check_adapter_files(folder: Path, lora_rank: int) -> None:
    """The LoRA adapter files agree with the recipe in finetune_config.json: present (readable, of its rank) exactly
    when it trained LoRA."""
    config_path, weights_path = (folder / name for name in PEFT_FILES)
    if not lora_rank:
        if config_path.exists() or weights_path.exists():
            raise ValueError(f"{folder / FINETUNE_CONFIG} says lora_rank 0 (no adapter), but the folder holds "
                             f"{config_path.name}; they must agree")
        return
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing ({FINETUNE_CONFIG} says lora_rank {lora_rank})")
    adapter = read_json(config_path)
    if adapter.get("r") != lora_rank:
        raise ValueError(f"{config_path}: r = {adapter.get('r')!r}, but {FINETUNE_CONFIG} says lora_rank "
                         f"{lora_rank}; they must agree")
    check_safetensors(weights_path)  # a truncated adapter is refused here, naming it (peft reads it after)


def load_finetuned(repo_id_or_path: str, checkpoint: Optional[str] = None, pretrained: bool = False,
                   merge: bool = True, device: str = "cpu", revision: Optional[str] = None) -> nn.Module:
    """The fine-tuned model saved by finetune, from a local folder or a Hub repository (snapshot_download:
    the HF cache, HF_HUB_OFFLINE honoured): the base timm model (weights from `checkpoint`, or timm's
    pretrained ones), its new head, the method with its learned parameters, and the LoRA adapter, merged
    into the weights unless merge=False (then a peft model). In eval mode. Without checkpoint or pretrained the
    base is timm's random initialisation under the recipe's seed, the one finetune started from then."""
    from peft import PeftModel

    from ..bench import build_base_model

    folder = hub_snapshot(repo_id_or_path, "a fine-tuned", revision=revision)
    data = read_versioned_json(folder, FINETUNE_CONFIG, FORMAT_VERSION, "a complete fine-tuned folder")
    recipe = FinetuneConfig(**{**data["recipe"], "crop_scale": tuple(data["recipe"]["crop_scale"])})
    _check_adapter_files(folder, recipe.lora_rank)
    if not checkpoint and not pretrained:  # timm's random init, as finetune drew it from the recipe's seed
        torch.manual_seed(recipe.seed)
    model = build_base_model(data["base_model"], checkpoint, pretrained, "cpu")
    if not recipe.distill:  # a distilled model keeps the base model's head
        model.reset_classifier(data["num_classes"])
    method = recipe.method_params()
    if method is not None:
        name, params = method
        learned_param = getattr(method_class(name), "learned_param", None)
        if learned_param is not None:
            params = {**params, learned_param: load_learned(name, folder)}
        apply(model, name, **params)
    if recipe.lora_rank:
        peft_model = PeftModel.from_pretrained(model, str(folder))
        model = peft_model.merge_and_unload() if merge else peft_model
    return model.to(device).eval()

