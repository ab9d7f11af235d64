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


def _calibrate(args: argparse.Namespace) -> int:
    import timm
    import torch
    from tqdm import tqdm

    from .bench import build_base_model
    from .calibrate import calibrate, save_preset
    from .data import open_images

    if args.limit < 1 or args.batch_size < 1:
        raise ValueError(f"--limit and --batch-size must be >= 1, got {args.limit} and {args.batch_size}")
    if not args.checkpoint and not args.pretrained:
        print("note: no --checkpoint or --pretrained: calibrating random weights", file=sys.stderr)
    base = build_base_model(args.model, args.checkpoint, args.pretrained, args.device)
    dataset = open_images(args.data, timm.data.create_transform(**timm.data.resolve_model_data_config(base)))
    dataset = torch.utils.data.Subset(dataset, range(min(args.limit, len(dataset))))
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, num_workers=args.num_workers)
    show = not args.no_progress
    batches = [x.to(args.device) for x, _ in tqdm(loader, desc="load images", disable=not show, file=sys.stderr)]
    with tqdm(desc="calibrate", unit="eval", disable=not show, file=sys.stderr) as bar:
        def step(msg: str) -> None:
            bar.set_postfix_str(msg, refresh=False)
            bar.update(1)

        result = calibrate(base, batches, args.model, target_gmacs=args.target_gmacs, target_ratio=args.target_ratio,
                           tolerance=args.tolerance, alpha=args.alpha, split_layer=args.split_layer, progress=step)
    p = result.params
    print(f"{args.model}: atm alpha={p['alpha']:g} beta={p['beta']:g} theta_min={p['theta_min']:.6f}"
          + ("" if p["split_layer"] is None else f" split_layer={p['split_layer']}"))
    print(f"on {result.images} images: {result.gmacs:.4f} GMACs per image ({result.gmacs / result.baseline_gmacs:.3f}x "
          f"of {result.baseline_gmacs:.4f}; target {result.target_gmacs:.4f}), agreement with the unmodified model "
          f"{result.agreement:.2f}% ({result.evaluations} evaluations)")
    save_preset(result, args.out)
    print(f"saved {args.out}; compare it with `tokcomp bench {args.model} --methods none,{args.out} --data ...`")
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

    cal = sub.add_parser("calibrate", help="find ATM thresholds that hit a GMACs budget on your images (no labels)")
    cal.add_argument("model", help="timm architecture, e.g. deit_tiny_patch16_224")
    target = cal.add_mutually_exclusive_group(required=True)
    target.add_argument("--target-gmacs", type=float, help="GMACs per image to reach")
    target.add_argument("--target-ratio", type=float, help="fraction of the unmodified model's GMACs, in (0, 1)")
    cal.add_argument("--data", required=True, help="folder of images (plain, labels.csv or ImageFolder; labels unused)")
    cal.add_argument("--checkpoint", help="weights file (.safetensors or torch) for the model")
    cal.add_argument("--pretrained", action="store_true", help="load timm's pretrained weights (Hub)")
    cal.add_argument("--limit", type=int, default=512, help="calibrate on the first N images (default %(default)s)")
    cal.add_argument("--tolerance", type=float, default=0.02, help="relative GMACs tolerance (default %(default)s)")
    cal.add_argument("--alpha", type=float, default=1.0, help="initial threshold, kept fixed (default %(default)s)")
    cal.add_argument("--split-layer", type=int, help="blocks after it use size-distinctive matching "
                                                    "(default: three quarters of the depth)")
    cal.add_argument("--batch-size", type=int, default=64)
    cal.add_argument("--device", default="cpu")
    cal.add_argument("--num-workers", type=int, default=2, help="data loading workers")
    cal.add_argument("--out", default="atm_preset.json", help="where to save the preset (default %(default)s)")
    cal.add_argument("--no-progress", action="store_true", help="hide progress bars")
    cal.set_defaults(func=_calibrate)
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
