"""ToCom compensators as standard peft LoRA adapters: one subfolder per plugin P_{i->i+1} (`step_XX`,
rank 2h on `blocks.*.attn.qkv`: A = [A_q; A_v], B with B_q in the query rows, B_v in the value rows,
exact zeros in the key rows, lora_alpha = s * 2h so that peft's scaling is s), plus `tocom_config.json`
and a model card. Loaded from a local folder or the Hugging Face Hub (huggingface_hub's
snapshot_download, which honours the HF cache and HF_HUB_OFFLINE)."""
import json
import shutil
import string
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from safetensors.torch import save_file

from ..utils.checks import MAX_BLOCKS, is_int
from ..utils.extras import require
from ..files.outputs import new_output, refuse_existing, replacing, write_text
from ..files.hub import hub_snapshot
from ..files.userfiles import inside, read_safetensors, read_versioned_json, safetensors_shapes
from .compensator import Compensator, check_scale

FORMAT_VERSION = 1
CONFIG_NAME = "tocom_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
SIGN_CONVENTION = "W(n) = W(m) + s * sign(n - m) * sum_{i in [min(m, n), max(m, n))} B_i A_i"
CARD_TEMPLATE = Path(__file__).resolve().parents[1] / "assets" / "tocom_card_template.md"  # -> hub_cards/


def step_folder(i: int) -> str:
    return f"step_{i:02d}"


def _key(block: int, part: str) -> str:
    return f"base_model.model.blocks.{block}.attn.qkv.lora_{part}.weight"


def save(compensator: Compensator, folder: str, base_model: str, method: str = "tome",
         method_settings: Optional[Dict[str, Any]] = None, training: str = "", results: str = "",
         repo_id: str = "", overwrite: bool = False) -> None:
    """Write the adapter repository layout to `folder` (created if needed). A folder that already holds a
    compensator (tocom_config.json) is refused unless overwrite (which also removes its step folders beyond this
    compensator's). Every file is written under a temporary name and renamed into place, tocom_config.json last: a
    folder is a loadable compensator only once all its step folders are complete."""
    LoraConfig = require("peft", "tocom", "saving a ToCom compensator").LoraConfig
    root = Path(folder)
    refuse_existing(root / CONFIG_NAME, overwrite, "folder")
    comp = compensator
    h, attn_dim, dim = comp.rank, comp.attn_dim, comp.dim
    lora = LoraConfig(r=2 * h, lora_alpha=comp.scale * 2 * h, target_modules=["qkv"], lora_dropout=0.0,
                      base_model_name_or_path=base_model, inference_mode=True)
    with tempfile.TemporaryDirectory() as staging:  # peft writes the (same) adapter_config.json of every step
        lora.save_pretrained(staging)
        adapter_config = (Path(staging) / ADAPTER_CONFIG).read_text()
    for i in range(comp.steps):
        sub = root / step_folder(i)
        write_text(sub / ADAPTER_CONFIG, adapter_config)
        tensors = {}
        for block in range(comp.depth):
            a = comp.lora_a[i, block].reshape(2 * h, dim)  # [A_q; A_v]
            b = torch.zeros(3 * attn_dim, 2 * h)
            b[:attn_dim, :h] = comp.lora_b[i, block, 0]
            b[2 * attn_dim:, h:] = comp.lora_b[i, block, 1]
            tensors[_key(block, "A")] = a.float().contiguous()
            tensors[_key(block, "B")] = b
        with replacing(sub / ADAPTER_WEIGHTS) as tmp:
            save_file(tensors, str(tmp))
    config = {
        "format_version": FORMAT_VERSION, "base_model": base_model, "depth": comp.depth, "width": dim,
        "attn_dim": attn_dim, "groups": comp.steps, "rank_per_projection": h, "lora_rank": 2 * h,
        "scale": comp.scale, "method": method, "method_settings": method_settings or {},
        "sign_convention": SIGN_CONVENTION, "target_modules": "blocks.*.attn.qkv",
        "subfolders": [step_folder(i) for i in range(comp.steps)],
    }
    card = string.Template(CARD_TEMPLATE.read_text()).safe_substitute(
        base_model=base_model, groups=comp.steps, last_group=comp.steps - 1, last_step=f"{comp.steps - 1:02d}",
        method=method, lora_rank=2 * h, rank=h, scale=comp.scale, repo_id=repo_id or "path/to/this/folder",
        training=training or "Not recorded.", results=results or "Not measured.")
    write_text(root / "README.md", card)
    for stale in sorted(root.glob("step_*")):  # an earlier compensator's steps beyond this one's
        if stale.is_dir() and stale.name not in config["subfolders"]:
            shutil.rmtree(stale)
    with new_output(root / CONFIG_NAME, overwrite, "folder") as tmp:
        tmp.write_text(json.dumps(config, indent=2) + "\n")


def _read_folder(root: Path) -> Tuple[Compensator, Dict[str, Any]]:
    config_path = root / CONFIG_NAME
    config = read_versioned_json(root, CONFIG_NAME, FORMAT_VERSION, "a ToCom compensator repository")
    sizes = {key: config.get(key) for key in ("depth", "width", "attn_dim", "rank_per_projection", "groups")}
    bad = [k for k, v in sizes.items() if not is_int(v) or v < 1]
    if bad:
        raise ValueError(f"{config_path}: {', '.join(bad)} must be integers >= 1, got {sizes}")
    for key in ("depth", "groups"):  # counts the checks below loop over: a stated maximum before any loop
        if sizes[key] > MAX_BLOCKS:
            raise ValueError(f"{config_path}: {key} {sizes[key]:,} is over the {MAX_BLOCKS:,} a compensator may "
                             "declare (no ViT has more blocks)")
    L, D, attn_dim, h, steps = (sizes[k] for k in ("depth", "width", "attn_dim", "rank_per_projection", "groups"))
    subfolders = config.get("subfolders")
    if not isinstance(subfolders, list) or len(subfolders) != steps:
        raise ValueError(f"{config_path}: groups = {steps} but subfolders lists "
                         f"{len(subfolders) if isinstance(subfolders, list) else subfolders!r}; they must agree")
    try:
        scale = check_scale(config.get("scale"))
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None
    on_disk = sorted(p.name for p in root.glob("step_*") if p.is_dir())
    if on_disk and on_disk != sorted(subfolders):
        raise ValueError(f"{config_path}: subfolders lists {subfolders}, but the folder holds {on_disk}; "
                         "they must agree")
    expected_keys = {_key(block, part) for block in range(L) for part in ("A", "B")}
    paths = [inside(root, name, config_path) / ADAPTER_WEIGHTS for name in subfolders]
    for path in paths:  # every size the config declares, against the files' headers, before anything is allocated
        shapes = safetensors_shapes(path)
        extra = sorted(set(shapes) - expected_keys)
        if extra:
            raise ValueError(f"{path} holds tensors that {CONFIG_NAME} (depth {L}) does not describe: "
                             f"{', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}; they must agree")
        for block in range(L):
            a, b = shapes.get(_key(block, "A")), shapes.get(_key(block, "B"))
            if a is None or b is None:
                raise ValueError(f"{path}: block {block} has no lora_A / lora_B for blocks.{block}.attn.qkv "
                                 f"({CONFIG_NAME} says depth {L})")
            if a != (2 * h, D) or b != (3 * attn_dim, 2 * h):
                raise ValueError(f"{path}: block {block} has lora_A {a} / lora_B {b}, expected "
                                 f"{(2 * h, D)} / {(3 * attn_dim, 2 * h)} from {CONFIG_NAME}")
    lora_a = torch.zeros(steps, L, 2, h, D)
    lora_b = torch.zeros(steps, L, 2, attn_dim, h)
    for i, path in enumerate(paths):
        tensors = read_safetensors(path)  # NaN or inf refused there, naming the tensor
        for block in range(L):
            a, b = tensors[_key(block, "A")], tensors[_key(block, "B")]
            if b[attn_dim:2 * attn_dim].any() or b[:attn_dim, h:].any() or b[2 * attn_dim:, :h].any():
                raise ValueError(f"{path}: block {block} lora_B is not block-structured (key rows or "
                                 "cross terms are not zero)")
            lora_a[i, block] = a.reshape(2, h, D)
            lora_b[i, block, 0] = b[:attn_dim, :h]
            lora_b[i, block, 1] = b[2 * attn_dim:, h:]
    base_model = config.get("base_model") if isinstance(config.get("base_model"), str) else ""
    return Compensator(lora_a, lora_b, scale, base_model), config


def load(repo_id_or_path: str, revision: Optional[str] = None, cache_dir: Optional[str] = None,
         token: Optional[str] = None, flag: Optional[str] = None) -> Tuple[Compensator, Dict[str, Any]]:
    """(compensator, tocom_config) from a local folder or a Hub repository (snapshot_download: uses
    the HF cache, honours HF_HUB_OFFLINE). Check it fits a model with tocom.check_fits / attach. flag: the CLI
    option that named it, for the error messages (None: a Python call)."""
    folder = hub_snapshot(repo_id_or_path, "a compensator", flag, revision=revision, cache_dir=cache_dir,
                          token=token, allow_patterns=[CONFIG_NAME, "README.md", "step_*/*"])
    return _read_folder(folder)


def push_to_hub(compensator: Compensator, repo_id: str, base_model: str, private: bool = False,
                token: Optional[str] = None, **save_kwargs: Any) -> str:
    """Save the layout to a temporary folder and upload it as the repository's content; returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        save(compensator, tmp, base_model, repo_id=repo_id, **save_kwargs)
        return str(api.upload_folder(repo_id=repo_id, folder_path=tmp, commit_message="ToCom compensator"))
