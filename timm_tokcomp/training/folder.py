"""The fine-tuned folder: written by finetune (the adapter and the method's parameters, then the card and
tokcomp_finetune.json last), checked and loaded by load_finetuned from a local path or the Hugging Face Hub."""
import json
import os
import tempfile
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import timm
import torch
from torch import nn

from ..core import apply
from ..utils.extras import require
from ..deployment.specs import MethodItem
from ..methods.learned import load_learned, save_learned
from ..methods import method_class
from ..models.build import build_base_model
from ..files.outputs import FILE_MODE, write_text
from ..patch import adapter_skip
from ..utils.checks import check_int
from ..files.hub import hub_snapshot
from ..files.userfiles import fail, read_json, read_versioned_json, safetensors_shapes
from .card import model_card
from .recipe import FinetuneConfig, FinetuneResult

FORMAT_VERSION = 1
FINETUNE_CONFIG = "tokcomp_finetune.json"
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
RUN_ENTRIES = (*PEFT_FILES, FINETUNE_CONFIG, "README.md", "*.safetensors", "*_config.json", "training")
READ_BACK = (*PEFT_FILES, FINETUNE_CONFIG, "README.md", "*.safetensors", "*_config.json")  # what load_finetuned reads
ADAPTER_FIELDS = ("peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "modules_to_save")
HEAD_KEY = "base_model.model.{}.weight"  # a new head's weight in the adapter (peft's modules_to_save)


def lora_config(config: FinetuneConfig, model: nn.Module, base_model: str):
    """The peft LoraConfig finetune trains with, from the recipe alone: LoRA on every qkv, a new head (none when
    distilling). load_finetuned builds the same, so no field of a folder's adapter_config.json reaches peft."""
    LoraConfig = require("peft", "train", "tokcomp finetune's LoRA").LoraConfig
    heads = [] if config.distill else [name for name in ("head", "head_dist")
                                       if isinstance(getattr(model, name, None), nn.Linear)]
    return LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha or config.lora_rank, target_modules=["qkv"],
                      lora_dropout=0.0, modules_to_save=heads, base_model_name_or_path=base_model)


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


def check_adapter_files(folder: Path, lora_rank: int) -> Tuple[Dict[str, Any], Dict[str, Tuple[int, ...]]]:
    """The LoRA adapter files agree with the recipe in finetune_config.json: present (readable, of its rank) exactly
    when it trained LoRA. Returns (adapter_config.json, the adapter's tensor shapes from its header); both empty
    without LoRA."""
    config_path, weights_path = (folder / name for name in PEFT_FILES)
    if not lora_rank:
        if config_path.exists() or weights_path.exists():
            raise ValueError(f"{folder / FINETUNE_CONFIG} says lora_rank 0 (no adapter), but the folder holds "
                             f"{config_path.name}; they must agree")
        return {}, {}
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing ({FINETUNE_CONFIG} says lora_rank {lora_rank})")
    adapter = read_json(config_path)
    if adapter.get("r") != lora_rank:
        raise ValueError(f"{config_path}: r = {adapter.get('r')!r}, but {FINETUNE_CONFIG} says lora_rank "
                         f"{lora_rank}; they must agree")
    return adapter, safetensors_shapes(weights_path)  # a truncated adapter is refused here (peft reads it after)


def check_adapter_config(adapter: Dict[str, Any], path: Path, expected) -> None:
    """The fields of adapter_config.json (adapter, read from path) that shape the adapter (ADAPTER_FIELDS) are
    those finetune writes for its recipe (expected: lora_config's LoraConfig); any other value (a pattern in
    target_modules, another rank) is refused naming the field, before peft sees it. peft then loads with
    `expected`, not the file."""
    want = expected.to_dict()

    def norm(value: Any) -> Any:
        if hasattr(value, "value"):  # an Enum (peft_type)
            value = value.value
        return sorted(value) if isinstance(value, (list, set, tuple)) else value

    for name in ADAPTER_FIELDS:
        got = adapter.get(name)
        if isinstance(got, (list, set, tuple)) and not all(isinstance(v, str) for v in got):
            raise fail(None, path, f"{name} = {got!r} is not what tokcomp finetune writes ({norm(want[name])!r})")
        if (norm(got) or None) != (norm(want[name]) or None):
            raise fail(None, path, f"{name} = {got!r} is not what tokcomp finetune writes for this folder's recipe "
                                   f"({norm(want[name])!r}); a fine-tuned folder is read back only as written")


def load_finetuned(repo_id_or_path: str, checkpoint: Optional[str] = None, pretrained: bool = False,
                   merge: bool = True, device: str = "cpu", revision: Optional[str] = None) -> nn.Module:
    """The fine-tuned model saved by finetune, from a local folder or a Hub repository (snapshot_download:
    the HF cache, HF_HUB_OFFLINE honoured): the base timm model (weights from `checkpoint`, or timm's
    pretrained ones), its new head, the method with its learned parameters, and the LoRA adapter, merged
    into the weights unless merge=False (then a peft model). In eval mode. Without checkpoint or pretrained the
    base is timm's random initialisation under the recipe's seed, the one finetune started from then."""
    PeftModel = require("peft", "train", "loading a fine-tuned folder").PeftModel

    folder = hub_snapshot(repo_id_or_path, "a fine-tuned", revision=revision, allow_patterns=list(READ_BACK))
    config_path = folder / FINETUNE_CONFIG
    data = read_versioned_json(folder, FINETUNE_CONFIG, FORMAT_VERSION, "a complete fine-tuned folder")
    recipe = _read_recipe(data, config_path)
    base_model, num_classes = _read_base(data, config_path)
    adapter, adapter_shapes = check_adapter_files(folder, recipe.lora_rank)
    if not recipe.distill:  # the new head's size, against the adapter's header, before the head is built
        rows = adapter_shapes.get(HEAD_KEY.format("head"), (None,))[0]
        if rows != num_classes:
            raise fail(None, config_path, f"says num_classes {num_classes}, but {PEFT_FILES[1]}'s head has "
                                          f"{rows} rows; they must agree")
    with torch.random.fork_rng(devices=[]):  # leaves the caller's random stream as it was
        torch.manual_seed(recipe.seed)  # what reset_classifier and apply draw, from the recipe's seed (loaded over)
        model = build_base_model(base_model, checkpoint, pretrained, "cpu", seed=recipe.seed)
        if not recipe.distill:  # a distilled model keeps the base model's head
            model.reset_classifier(num_classes)
        method = recipe.parse_method()
        if method is not None:
            name, params = method.method, method.params
            cls = method_class(name)
            if cls.learns(params):
                params = {**params, cls.spec.learned_param: load_learned(name, folder)}
            apply(model, name, **params)
        if recipe.lora_rank and not merge and adapter_skip(model) is not None:
            raise ValueError(f"merge=False: {adapter_skip(model)}; load it with merge=True (the adapter merged into "
                             f"the weights)")
        if recipe.lora_rank:
            expected = lora_config(recipe, model, base_model)
            check_adapter_config(adapter, folder / PEFT_FILES[0], expected)
            peft_model = PeftModel.from_pretrained(model, str(folder), config=expected)
            model = peft_model.merge_and_unload() if merge else peft_model
    return model.to(device).eval()


def _read_recipe(data: Dict[str, Any], path: Path) -> FinetuneConfig:
    """The recipe of tokcomp_finetune.json: fields of FinetuneConfig only, each valid (one missing takes its
    default, as finetune ran before the field existed)."""
    recipe = data.get("recipe")
    if not isinstance(recipe, dict):
        raise fail(None, path, f"recipe must be a JSON object, got {type(recipe).__name__}")
    unknown = sorted(set(recipe) - {f.name for f in fields(FinetuneConfig)})
    if unknown:
        raise fail(None, path, f"recipe has fields tokcomp finetune does not write: {', '.join(unknown)}")
    crop = recipe.get("crop_scale")
    try:  # a field missing (written before it existed) takes its default, which it then ran with
        config = FinetuneConfig(**{**recipe, **({"crop_scale": tuple(crop)} if isinstance(crop, list) else {})})
        config.validate()
    except (ValueError, TypeError) as e:
        raise fail(None, path, f"recipe: {e}") from None
    return config


def _read_base(data: Dict[str, Any], path: Path):
    """(base_model, num_classes) of tokcomp_finetune.json. The base model is a timm architecture name only: a
    folder, 'local-dir:' or 'hf-hub:' name in a file would open or download what its author chose (a local base
    is the caller's checkpoint argument)."""
    base, classes = data.get("base_model"), data.get("num_classes")
    if not isinstance(base, str) or "/" in base or ":" in base or "\\" in base or not timm.is_model(base):
        raise fail(None, path, f"base_model {base!r} is not a timm model name; a fine-tuned folder names its base "
                               f"by timm name only (give local weights as checkpoint=FILE)")
    try:
        return base, check_int("num_classes", classes, 1)
    except ValueError as e:
        raise fail(None, path, str(e)) from None
