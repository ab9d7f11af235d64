"""Training: the one loop (engine) and the parameter-efficient fine-tuning task (finetune) that PYRA and the learned
reducers use; ToCom's self-distillation task lives in tocom.train."""
from .finetune import FinetuneConfig, FinetuneResult, finetune, load_finetuned

__all__ = ["FinetuneConfig", "FinetuneResult", "finetune", "load_finetuned"]
