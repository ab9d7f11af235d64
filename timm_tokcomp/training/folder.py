"""The fine-tuned folder: written by finetune (the adapter and the method's parameters, then the card and
tokcomp_finetune.json last), checked and loaded by load_finetuned from a local path or the Hugging Face Hub."""
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch import nn

from ..core import apply
from ..extras import require
from ..kit.grammar import MethodItem
from ..learned import load_learned, save_learned
from ..methods import method_class
from ..models import build_base_model
from ..outputs import FILE_MODE, write_text
from ..patch import adapter_skip
from ..hub import hub_snapshot
from ..userfiles import check_safetensors, read_json, read_versioned_json
from .card import model_card
from .recipe import FinetuneConfig, FinetuneResult

FORMAT_VERSION = 1
FINETUNE_CONFIG = "tokcomp_finetune.json"
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
RUN_ENTRIES = (*PEFT_FILES, FINETUNE_CONFIG, "README.md", "*.safetensors", "*_config.json", "training")


def save_folder(peft_model, model: nn.Module, out: str, base_model: str, num_classes: int,
                config: FinetuneConfig, method: Optional[MethodItem]) -> Dict[str, Any]:
    """The adapter and the method's parameters; tokcomp_finetune.json (without results) last. Returns what
    that file holds."""
    if config.lora_rank:
        with tempfile.TemporaryDirectory(dir=out, prefix=".peft-") as staging:  # peft writes in place: stage, rename
            peft_model.save_pretrained(staging, save_embedding_layers=False)  # no Hub lookup of the base model
            for name in PEFT_FILES:
                os.chmod(Path(staging) / name, FILE_MODE)  # as every other output
                os.replace(Path(staging) / name, Path(out) / name)
    learned = getattr(model, "tokcomp", None)
    if learned is not None:
        save_learned(learned[method.method], method.method, out)
    data = {"base_model": base_model, "num_classes": num_classes, "recipe": asdict(config)}
    _write_config(out, data)
    return data


def _write_config(out: str, data: Dict[str, Any]) -> None:
    write_text(Path(out) / FINETUNE_CONFIG, json.dumps({"format_version": FORMAT_VERSION, **data}, indent=2) + "\n")


def finish_folder(out: str, saved: Dict[str, Any], base_model: str, eval_data: str, train_data: str,
                  train_images: int, config: FinetuneConfig, result: FinetuneResult) -> None:
    """The model card, then tokcomp_finetune.json (saved: what save_folder wrote) with the results."""
    data = dict(saved)
    data["results"] = {**asdict(result), "eval_data": str(eval_data), "train_data": str(train_data),
                       "train_images": train_images}
    write_text(Path(out) / "README.md", model_card(base_model, config, result, train_data, eval_data, train_images))
    _write_config(out, data)


def check_adapter_files(folder: Path, lora_rank: int) -> None:
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
    PeftModel = require("peft", "train", "loading a fine-tuned folder").PeftModel

    folder = hub_snapshot(repo_id_or_path, "a fine-tuned", revision=revision)
    data = read_versioned_json(folder, FINETUNE_CONFIG, FORMAT_VERSION, "a complete fine-tuned folder")
    recipe = FinetuneConfig(**{**data["recipe"], "crop_scale": tuple(data["recipe"]["crop_scale"])})
    check_adapter_files(folder, recipe.lora_rank)
    with torch.random.fork_rng(devices=[]):  # leaves the caller's random stream as it was
        torch.manual_seed(recipe.seed)  # what reset_classifier and apply draw, from the recipe's seed (loaded over)
        model = build_base_model(data["base_model"], checkpoint, pretrained, "cpu", seed=recipe.seed)
        if not recipe.distill:  # a distilled model keeps the base model's head
            model.reset_classifier(data["num_classes"])
        method = recipe.parse_method()
        if method is not None:
            name, params = method.method, method.params
            cls = method_class(name)
            if cls.learns(params):
                params = {**params, cls.learned_param: load_learned(name, folder)}
            apply(model, name, **params)
        if recipe.lora_rank and not merge and adapter_skip(model) is not None:
            raise ValueError(f"merge=False: {adapter_skip(model)}; load it with merge=True (the adapter merged into "
                             f"the weights)")
        if recipe.lora_rank:
            peft_model = PeftModel.from_pretrained(model, str(folder))
            model = peft_model.merge_and_unload() if merge else peft_model
    return model.to(device).eval()
