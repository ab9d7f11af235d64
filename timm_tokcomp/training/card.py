"""The model card (README.md) of a fine-tuned folder: what it is, how it was trained, what it scored, and
how to load it."""
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .recipe import FinetuneConfig, FinetuneResult


def model_card(base_model: str, config: "FinetuneConfig", result: "FinetuneResult", train_data: str, eval_data: str,
               train_images: int) -> str:
    method = config.method + "".join(f", {k}={v!r}" for k, v in config.method_args.items())
    return f"""---
library_name: peft
base_model: {base_model}
tags: [timm, token-reduction, timm_tokcomp, lora]
---
# {base_model} + LoRA, token reduction `{method}`

A parameter-efficient fine-tune of the timm model `{base_model}` made by `tokcomp finetune`
(timm_tokcomp): {f"LoRA rank {config.lora_rank} (alpha {config.lora_alpha or config.lora_rank:g}) on every block's `qkv`" if config.lora_rank else "no LoRA (the backbone frozen)"}{" (the model's own head kept)" if config.distill else " and a new head"}, plus the method's own {result.method_parameters:,} parameters: {result.trainable_parameters:,}
trained parameters in all, with the token-reduction method `{method}` active in training and inference.

## Results (the saved model reloaded, LoRA merged)

| evaluation images | top-1 | agreement with the unreduced model | GMACs / image | images / s (forward, batch {config.eval_batch_size}) |
| --- | --- | --- | --- | --- |
| {result.images} (`{eval_data}`) | {_percent(result.top1)} | {_percent(result.agreement)} | {result.gmacs:.4f} | {result.images_per_second:.1f} |

GMACs are counted from a run (timm_tokcomp.measure.counting). Throughput is from the machine that trained it.

## Recipe

{train_images} {"images, labels unused: the unreduced model's outputs learned by KL (temperature 1)" if config.distill else "labelled images"} (`{train_data}`); {config.epochs} epochs of batch {config.batch_size}, AdamW (lr
{config.lr:g}, weight decay {config.weight_decay:g}), {config.warmup_epochs} warm-up epoch(s) then cosine decay;
augmentation `{config.augment}` (crop area {config.crop_scale[0]:g}-{config.crop_scale[1]:g}); seed {config.seed}.
Training took {result.train_seconds / 60:.1f} minutes.

## Use

```python
from timm_tokcomp.training import load_finetuned
model = load_finetuned("path/or/hub-repo", pretrained=True)  # or checkpoint="base_weights.safetensors"
```

{_adapter_files(config)}; the method's parameters, if it has any, are in `<method>.safetensors` with
`<method>_config.json`, and `tokcomp_finetune.json` records the base model, the method and this recipe.
"""


def _percent(value) -> str:
    return "-" if value is None else f"{value:.2f}%"


def _adapter_files(config: "FinetuneConfig") -> str:
    if not config.lora_rank:
        return "The folder holds no LoRA adapter (the backbone was not changed)"
    head = "" if config.distill else ", with the head in `modules_to_save`"
    return f"The folder is a standard peft adapter (`adapter_config.json`, `adapter_model.safetensors`{head})"
