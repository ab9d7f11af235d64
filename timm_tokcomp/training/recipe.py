"""The fine-tuning recipe (FinetuneConfig, checked before any work) and what a finished run reports
(FinetuneResult)."""
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from ..deployment.specs import MethodItem
from ..methods import METHODS, make_reducer, method_class, parse_method_tag
from .config import CROP_SCALE, SEED, CheckedFields, bool_field, choice_field, int_field, real_field
from .engine import check_loop_settings

NO_METHOD = "none"
AUGMENTS = ("crop-flip", "none")


@dataclass
class FinetuneConfig(CheckedFields):
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
    warmup_epochs: Optional[int] = None  # None: 1, or 0 for a single epoch
    lora_rank: int = 8  # 0: no LoRA, only the method's parameters train (with distill)
    lora_alpha: Optional[float] = None
    augment: str = "crop-flip"
    crop_scale: Tuple[float, float] = (0.5, 1.0)
    seed: int = 0
    eval_batch_size: int = 64
    distill: bool = False
    amp: Optional[bool] = None  # None: on for CUDA, off on CPU
    amp_dtype: str = "bfloat16"
    accumulate: int = 1  # batches per optimiser step (the global batch is batch_size x processes x accumulate)

    def __post_init__(self) -> None:
        if self.warmup_epochs is None and isinstance(self.epochs, int) and not isinstance(self.epochs, bool):
            self.warmup_epochs = 1 if self.epochs > 1 else 0  # the default fits every valid epochs

    FIELDS = (*(int_field(name, 1) for name in ("epochs", "batch_size", "eval_batch_size")),
              SEED, *(int_field(name, 0) for name in ("warmup_epochs", "lora_rank")),
              real_field("lr"), real_field("weight_decay", strict=False), real_field("lora_alpha", allow_none=True),
              bool_field("distill"), choice_field("augment", AUGMENTS), CROP_SCALE)

    def validate(self) -> Optional[MethodItem]:
        """Raise ValueError naming the command-line flag of the first bad setting, before any work; return the
        method, parsed (parse_method), for the run to carry."""
        self.validate_fields()
        if self.warmup_epochs >= self.epochs:
            raise ValueError(f"--warmup-epochs must be in [0, epochs={self.epochs}), got {self.warmup_epochs}")
        check_loop_settings(self.amp, self.amp_dtype, self.accumulate)
        method = self.parse_method()  # raises for an unknown tag or parameter
        if method is not None and method.params.get("kernel") == "triton":
            raise ValueError("--method-arg kernel=triton: the Triton kernels are inference-only (no backward); "
                             "training runs kernel=torch or kernel=auto")
        if self.lora_rank == 0 and not (self.distill and method is not None
                                        and method_class(method.method).learns(method.params)):
            learned = ", ".join(name for name, cls in METHODS.items() if cls.spec.learned_param is not None)
            raise ValueError("--lora-rank 0 (no LoRA: only the method's parameters train) needs --distill and a method "
                             f"with learned parameters ({learned})")
        if method is not None:
            try:  # a bad value (e.g. form='wide') fails here, before --overwrite deletes an earlier run
                make_reducer(method.method, **method.params)
            except (TypeError, ValueError) as e:
                raise ValueError(f"--method-arg: {e}") from None
        return method

    def parse_method(self) -> Optional[MethodItem]:
        """The method of the tag and method_args, read once where the recipe enters (validate, or a saved folder's
        recipe) and carried from there; None for 'none'."""
        if self.method == NO_METHOD:
            if self.method_args:
                raise ValueError(f"--method-arg needs a --method; got {self.method_args} with --method none")
            return None
        try:
            name, params = parse_method_tag(self.method)
        except ValueError as e:
            raise ValueError(f"--method: {e}; or '{NO_METHOD}'") from None
        learned = method_class(name).spec.learned_param
        if learned is not None and learned in self.method_args:
            raise ValueError(f"--method-arg {learned} cannot be given: the method's parameters are trained here")
        valid = method_class(name).param_names()
        unknown = sorted(set(self.method_args) - set(valid))
        if unknown:
            raise ValueError(f"--method-arg: unknown parameter(s) {unknown} for {name}; valid: {list(valid)}")
        return MethodItem(self.method, name, {**params, **self.method_args})


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
