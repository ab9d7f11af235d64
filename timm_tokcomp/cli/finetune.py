"""`tokcomp finetune`: LoRA, a head and the method's parameters (PYRA's recipe), or distillation."""
import argparse
import json
from typing import List

from ..files.bounded import json_bounds
from ..methods import FAMILIES, parameter_table
from ..training.config import check_crop_min
from ..training.recipe import AUGMENTS, FinetuneConfig
from ..utils.checks import flag_type
from .flags import FOLDER_OUT, batch_size_flag, model_flags, training_flags, weights_flags


def add(sub: argparse._SubParsersAction) -> None:
    ft = sub.add_parser("finetune", help="parameter-efficient fine-tuning on labelled images: LoRA on qkv, a new "
                                         "head and the method's own parameters (PYRA's recipe); with --distill, on "
                                         "unlabelled images, learning the unreduced model's outputs")
    model_flags(ft, "timm architecture, e.g. deit_tiny_patch16_224")
    ft.add_argument("--method", default="none", help=f"token reduction trained with: a method tag ({FAMILIES}) "
                                                     f"or none (default: %(default)s)")
    ft.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                    help=f"another method parameter, e.g. form=pooled (repeatable); KEY is one of "
                         f"{', '.join(dict.fromkeys(row[0] for row in parameter_table()))} "
                         f"(`tokcomp methods` says what each sets and which methods take it)")
    ft.add_argument("--data", required=True, help="training images: a labels.csv folder, a labels .csv file, or an "
                                                  "ImageFolder tree (with --distill also a plain image folder)")
    ft.add_argument("--eval-data", help="images evaluated after every epoch and at the end (default: --data)")
    ft.add_argument("--distill", action="store_true", help="no labels: keep the model's head and learn the unreduced "
                                                          "model's outputs (KL, temperature 1); --data may be any image "
                                                          "folder; the evaluation reports agreement with the unreduced model")
    ft.add_argument("--out", required=True, help="folder to write: peft adapter, method parameters, card, training/")
    weights_flags(ft)
    ft.add_argument("--epochs", type=FinetuneConfig.field_type("epochs"), default=10, help="(default: %(default)s)")
    batch_size_flag(ft, 32)
    ft.add_argument("--lr", type=FinetuneConfig.field_type("lr", float), default=3e-3,
                    help="AdamW peak learning rate, as given (timm's --lr; "
                         "default: %(default)s)")
    ft.add_argument("--weight-decay", type=FinetuneConfig.field_type("weight_decay", float), default=1e-4)
    ft.add_argument("--warmup-epochs", type=FinetuneConfig.field_type("warmup_epochs"),
                    help="linear warm-up before the cosine decay (default: 1, or 0 "
                         "with --epochs 1)")
    ft.add_argument("--lora-rank", type=FinetuneConfig.field_type("lora_rank"), default=8,
                    help="0: no LoRA, the backbone stays frozen and only the "
                         "method's parameters train (with --distill; default: "
                         "%(default)s)")
    ft.add_argument("--lora-alpha", type=FinetuneConfig.field_type("lora_alpha", float),
                    help="LoRA alpha (default: the rank, i.e. scaling 1)")
    ft.add_argument("--augment", choices=AUGMENTS, default="crop-flip",
                    help="random resized crops and flips, or none (default: %(default)s)")
    ft.add_argument("--crop-min", type=flag_type(check_crop_min, float), default=0.5,
                    help="smallest random-crop area (default: %(default)s)")
    ft.add_argument("--eval-batch-size", type=FinetuneConfig.field_type("eval_batch_size"), default=64)
    training_flags(ft, "epoch")
    ft.set_defaults(func=run, outputs=(FOLDER_OUT,))


def run(args: argparse.Namespace) -> int:
    from ..measure.precision import check_device
    from ..training import FinetuneConfig, finetune
    from ..training.engine import distributed, rank_and_world

    config = FinetuneConfig(
        method=args.method, method_args=_method_args(args.method_arg), epochs=args.epochs, batch_size=args.batch_size,
        lr=args.lr, weight_decay=args.weight_decay, warmup_epochs=args.warmup_epochs, lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha, augment=args.augment, crop_scale=(args.crop_min, 1.0), seed=args.seed,
        eval_batch_size=args.eval_batch_size, distill=args.distill, amp=args.amp, amp_dtype=args.amp_dtype,
        accumulate=args.accumulate)
    config.validate()
    check_device(args.device)
    with distributed(args.device) as device:  # under torchrun: the process group, one GPU per process
        writer = rank_and_world()[0] == 0
        if not args.checkpoint and not args.pretrained and writer:
            args.notes.append("no --checkpoint or --pretrained: random weights were fine-tuned")
        result = finetune(args.model, args.data, args.out, args.eval_data, config, checkpoint=args.checkpoint,
                          pretrained=args.pretrained, resume=args.resume, overwrite=args.overwrite, device=device,
                          show_progress=not args.no_progress, num_workers=args.num_workers,
                          stop_after_epoch=args.stop_after)
    if not writer:
        return 0
    if result is None:
        print(f"stopped after epoch {args.stop_after} of {config.epochs}; continue with --resume")
        return 0
    scores = ([] if result.top1 is None else [f"top-1 {result.top1:.2f}%"]) + \
        ([] if result.agreement is None else [f"agreement with the unreduced model {result.agreement:.2f}%"])
    print(f"saved {args.out}: {', '.join(scores)} on {result.images} images, {result.gmacs:.4f} GMACs/image, "
          f"{result.images_per_second:.1f} images/s, {result.trainable_parameters:,} trained parameters "
          f"({result.method_parameters:,} of them the method's), {result.train_seconds / 60:.1f} min of training")
    return 0


def _method_args(items: List[str]) -> dict:
    """['form=pooled', 'prop_attn=false'] -> {'form': 'pooled', 'prop_attn': False}; values are JSON (within the
    bounds every JSON the package reads keeps: files.bounded) or text."""
    parsed = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--method-arg must be KEY=VALUE, got {item!r}")
        problem = json_bounds(value)
        if problem is not None:
            raise ValueError(f"--method-arg {key}= {problem}")
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    return parsed
