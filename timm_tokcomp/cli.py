"""The `tokcomp` command line."""
import argparse
import sys
from typing import List, Optional

from .methods import TAG_FORMS


def _bench(args: argparse.Namespace) -> int:
    from .bench import format_table, plot_pareto, run_bench, write_csv

    if not args.checkpoint and not args.pretrained:
        print("note: no --checkpoint or --pretrained: random weights, accuracy columns are meaningless",
              file=sys.stderr)
    rows = run_bench(
        args.model,
        methods=args.methods.split(","),
        checkpoint=args.checkpoint,
        pretrained=args.pretrained,
        data=args.data,
        batch_size=args.batch_size,
        device=args.device,
        timing_rounds=args.timing_rounds,
        limit=args.limit,
        num_workers=args.num_workers,
        show_progress=not args.no_progress,
    )
    print(format_table(rows))
    if args.out:
        write_csv(rows, args.out, args.model)
    if args.plot:
        plot_pareto(rows, args.plot, args.model)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokcomp", description="Token compression for timm ViTs.")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="GMACs / throughput / accuracy table of several methods, side by side")
    bench.add_argument("model", nargs="?", default="deit_tiny_patch16_224", help="timm architecture (default %(default)s)")
    bench.add_argument("--methods", default="none,tome_r8,tome_r16",
                       help=f"comma list of 'none' and method tags ({', '.join(TAG_FORMS)}); default %(default)s")
    bench.add_argument("--checkpoint", help="weights file (.safetensors or torch) for the model")
    bench.add_argument("--pretrained", action="store_true", help="load timm's pretrained weights (Hub)")
    bench.add_argument("--data", help="ImageFolder tree or folder with labels.csv (file,label); "
                                      "without it, random inputs and no accuracy")
    bench.add_argument("--batch-size", type=int, default=64)
    bench.add_argument("--device", default="cpu")
    bench.add_argument("--timing-rounds", type=int, default=5, help="timed forwards per method (median)")
    bench.add_argument("--limit", type=int, help="evaluate only the first N images")
    bench.add_argument("--num-workers", type=int, default=2, help="data loading workers")
    bench.add_argument("--out", help="write the table as CSV")
    bench.add_argument("--plot", help="write a GMACs-vs-accuracy Pareto plot (PNG)")
    bench.add_argument("--no-progress", action="store_true", help="hide progress bars")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"tokcomp: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
