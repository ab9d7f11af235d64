"""Training: the one loop (engine) and its tasks: the parameter-efficient fine-tuning (finetune) that PYRA and the
learned reducers use, and ToCom's self-distillation (tocom, with its mosaic images and held-out scale choice); the
compensators they train run from timm_tokcomp.tocom."""
from .finetune import FinetuneConfig, FinetuneResult, finetune, load_finetuned

__all__ = ["FinetuneConfig", "FinetuneResult", "finetune", "load_finetuned"]
