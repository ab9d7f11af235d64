"""One training engine: the shared loop pieces (engine) and the supervised parameter-efficient fine-tuning
(finetune) that PYRA and the learned reducers use; ToCom's self-distillation lives in tocom.train."""
from .finetune import FinetuneConfig, FinetuneResult, finetune, load_finetuned

__all__ = ["FinetuneConfig", "FinetuneResult", "finetune", "load_finetuned"]
