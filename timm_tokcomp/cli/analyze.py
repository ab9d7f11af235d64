"""`tokcomp analyze`: what several methods do to every patch, compared, drawn and reported."""
import argparse

from ..methods import FAMILIES
from ..commands.analyze.report import LIMIT, OVERLAYS
from ..utils.checks import flag_type
from .flags import FOLDER_OUT, batch_size_flag, device_flag, model_flags, progress_flag, weights_flags


def add(sub: argparse._SubParsersAction) -> None:
    an = sub.add_parser("analyze", help="record what several methods do to every patch, compare them with the "
                                        "study's pattern metrics, draw pictures, write a Markdown report")
    model_flags(an, "timm architecture, e.g. deit_tiny_patch16_224")
    an.add_argument("--methods", default="tome_r8,evit_r8,atm",
                    help=f"comma list of two or more method tags ({FAMILIES}) or presets; default: %(default)s")
    an.add_argument("--data", required=True, help="folder of images (labels.csv, ImageFolder or plain; labels unused)")
    an.add_argument("--limit", type=flag_type(LIMIT), default=256, help="first N images (default: %(default)s)")
    an.add_argument("--out", required=True, help="report folder")
    weights_flags(an)
    batch_size_flag(an, 32)
    an.add_argument("--overlays", type=flag_type(OVERLAYS), default=4,
                    help="images drawn with each method's groups (default: %(default)s)")
    device_flag(an)
    an.add_argument("--resume", action="store_true", help="reuse OUT: recordings with the same settings are kept, "
                                                          "the rest is redrawn")
    an.add_argument("--overwrite", action="store_true",
                    help="replace the previous report in OUT (set aside, deleted when this run ends)")
    progress_flag(an)
    an.set_defaults(func=run, outputs=(FOLDER_OUT,))


def run(args: argparse.Namespace) -> int:
    from ..commands.analyze.report import run_analysis

    methods = [item.strip() for item in args.methods.split(",") if item.strip()]
    run_analysis(args.model, methods, args.data, args.out, limit=args.limit, checkpoint=args.checkpoint,
                 pretrained=args.pretrained, batch_size=args.batch_size, overlays=args.overlays, device=args.device,
                 resume=args.resume, overwrite=args.overwrite, show_progress=not args.no_progress)
    print(f"wrote {args.out}/report.md (and metrics.csv, the pictures, records/)")
    return 0
