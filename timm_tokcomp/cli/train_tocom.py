"""`tokcomp train-tocom`: ToCom compensator plugins by self-distillation."""
import argparse

from ..methods import tocom_methods
from ..training.config import check_crop_min
from ..training.tocom import HOLDOUT_PICKS, TrainConfig
from ..utils.checks import comma_list, flag_type
from .flags import FOLDER_OUT, batch_size_flag, deprecated, model_flags, random_weights, training_flags, weights_flags



def add(sub: argparse._SubParsersAction) -> None:
    tr = sub.add_parser("train-tocom", help="train ToCom compensator plugins by self-distillation (no labels); "
                                            "runs under torchrun --nproc_per_node=N too")
    model_flags(tr, "timm architecture, e.g. deit_tiny_patch16_224")
    weights_flags(tr)
    tr.add_argument("--data", required=True, help="folder of images (plain, labels.csv or ImageFolder; labels unused)")
    tr.add_argument("--out", required=True, help="adapter repository folder to write (training state in OUT/training)")
    tr.add_argument("--steps", type=TrainConfig.field_type("steps"), default=1100,
                    help="optimizer steps (default: %(default)s)")
    batch_size_flag(tr, 32, "images per step and process (default: %(default)s)")
    tr.add_argument("--lr-base", dest="lr", type=TrainConfig.field_type("lr", float), default=0.03,
                    help="AdamW lr per 256 images, scaled by the global batch (timm's --lr-base; default: %(default)s)")
    deprecated(tr, "--lr", "--lr-base (the same per-256-images rate)", "lr", type=TrainConfig.field_type("lr", float))
    tr.add_argument("--weight-decay", type=TrainConfig.field_type("weight_decay", float), default=0.01)
    tr.add_argument("--warmup-steps", type=TrainConfig.field_type("warmup_steps"),
                    help="linear warmup before the cosine decay (default: 5%% of steps)")
    tr.add_argument("--temperature", type=TrainConfig.field_type("temperature", float), default=1.0,
                    help="KL softmax temperature (default: %(default)s)")
    tr.add_argument("--scale", type=TrainConfig.field_type("scale", float), default=0.1,
                    help="plugin scale s during training (default: %(default)s)")
    tr.add_argument("--lora-rank", dest="rank", type=TrainConfig.field_type("rank"), default=2,
                    help="LoRA rank h per projection and step (default: %(default)s)")
    deprecated(tr, "--rank", "--lora-rank", "rank", type=TrainConfig.field_type("rank"))
    tr.add_argument("--groups", type=TrainConfig.field_type("groups"), default=16,
                    help="plugins, i.e. the largest r (default: %(default)s)")
    tr.add_argument("--method", choices=tocom_methods(), default="tome", help="token reduction trained with")
    tr.add_argument("--crop-min", type=flag_type(check_crop_min, float), default=0.5,
                    help="smallest random-crop area (default: %(default)s)")
    tr.add_argument("--mosaic", type=TrainConfig.field_type("mosaic", comma_list(int)), default="2,3",
                    help="grid sizes g: each input is a g x g mosaic of crops, so small "
                         "images are upscaled less (1: plain crops; default: %(default)s)")
    tr.add_argument("--holdout", type=TrainConfig.field_type("holdout"), default=500,
                    help="N images never trained on: held-out loss and the "
                         "choice of the scale (default: %(default)s)")
    tr.add_argument("--holdout-pick", choices=HOLDOUT_PICKS, default="spread",
                    help="which images are held out: evenly spaced through the sorted folder, so a folder sorted by "
                         "class is held out across its classes, or its last N (default: %(default)s)")
    tr.add_argument("--scale-grid", type=TrainConfig.field_type("scale_grid", comma_list(float)),
                    default="0.05,0.075,0.1,0.125,0.15", help="scales tried on the held-out images")
    tr.add_argument("--scale-targets", type=TrainConfig.field_type("scale_targets", comma_list(int)),
                    default="4,8,12,16",
                    help="targets r (source 0) whose mean held-out loss chooses the scale (default: %(default)s)")
    tr.add_argument("--checkpoint-every", type=TrainConfig.field_type("checkpoint_every"), default=50,
                    help="steps between checkpoints (default: %(default)s)")
    training_flags(tr, "step")
    tr.set_defaults(func=run, outputs=(FOLDER_OUT,))


def run(args: argparse.Namespace) -> int:
    from ..models.build import build_base_model
    from ..measure.precision import check_device
    from ..training.tocom import TrainConfig, train_tocom
    from ..training.engine import distributed, rank_and_world

    config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps, temperature=args.temperature, scale=args.scale, rank=args.rank,
        groups=args.groups, method=args.method, crop_scale=(args.crop_min, 1.0),
        mosaic=args.mosaic, holdout=args.holdout,
        holdout_pick=args.holdout_pick,
        scale_grid=args.scale_grid, scale_targets=args.scale_targets,
        checkpoint_every=args.checkpoint_every, seed=args.seed, amp=args.amp, amp_dtype=args.amp_dtype,
        accumulate=args.accumulate)
    config.validate()
    check_device(args.device)
    with distributed(args.device) as device:  # under torchrun: the process group, one GPU per process
        writer = rank_and_world()[0] == 0
        if random_weights(args) and writer:
            args.notes.append("no --checkpoint or --pretrained: the plugins were trained for random weights")
        model = build_base_model(args.model, args.checkpoint, args.pretrained, "cpu", seed=args.seed,
                                 trains="tokcomp train-tocom")
        _, report = train_tocom(model, args.data, args.out, args.model, config, resume=args.resume, device=device,
                                show_progress=not args.no_progress, num_workers=args.num_workers,
                                stop_after=args.stop_after, overwrite=args.overwrite)
        if not writer:
            return 0
        if args.stop_after is not None and args.stop_after < config.steps:
            print(f"stopped after step {args.stop_after} of {config.steps}; continue with --resume")
        elif report is not None:
            print(f"saved {args.out}; held-out distillation loss, source r = 0, scale {report.chosen_scale:g}:")
            for (m, n), plain, comp, change in report.changes(report.chosen_scale):
                print(f"  -> r = {n:2d}: {plain:.4f} without ToCom, {comp:.4f} with ({change:+.1f}%)")
    return 0
