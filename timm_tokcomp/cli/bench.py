"""`tokcomp bench`: GMACs, throughput, latency and accuracy of several methods side by side."""
import argparse

from ..methods import FAMILIES
from ..commands.bench.run import LATENCY_RUNS, SOURCE_R
from ..files.data import LIMIT
from ..tocom.compensator import check_scale
from ..utils.checks import flag_type, integer
from .flags import (FILE_OUT, batch_size_flag, deprecated, device_flag, hf_model_flag, model_flags,
                    num_workers_flag, precision_flags, progress_flag, random_weights, weights_flags)

ROUNDS = integer("--rounds", 1, "(--no-timing times nothing)")  # the command's: 0 is --no-timing


def add(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="GMACs / throughput / accuracy table of several methods, side by side")
    model_flags(bench, "timm architecture (default: deit_tiny_patch16_224), --hf-model, or open_clip:ARCH (its image "
                       "tower, zero-shot ImageNet head)")
    bench.add_argument("--methods", default="none,tome_r8,tome_r16",
                       help=f"comma list of 'none' and method tags ({FAMILIES}); default: %(default)s")
    weights_flags(bench)
    hf_model_flag(bench)
    bench.add_argument("--data", help="ImageFolder tree or folder with labels.csv (file,label): top-1 and "
                                      "agreement; a plain folder of images: agreement only; without it, "
                                      "random inputs and no accuracy")
    batch_size_flag(bench, 64)
    device_flag(bench)
    precision_flags(bench)
    bench.add_argument("--modes", dest="backend", choices=("eager", "compile", "onnx"), default="eager",
                       help="the execution mode of the timed forwards (one; a preset's row runs in its own): PyTorch "
                            "eager, torch.compile, or the ONNX export in onnxruntime (CPU, fp32; needs the export "
                            "extra); default: %(default)s")
    bench.add_argument("--torchcompile", dest="backend", action="store_const", const="compile",
                       help="timm's spelling of --modes compile")
    deprecated(bench, "--backend", "--modes", "backend", choices=("eager", "compile", "onnx"))
    bench.add_argument("--latency-runs", type=flag_type(LATENCY_RUNS), default=30,
                       help="single-image forwards timed per method for latency (median, p90; 0: none; "
                            "default: %(default)s)")
    bench.add_argument("--rounds", dest="timing_rounds", type=flag_type(ROUNDS), default=5,
                       help="timed rounds, each one forward of every method, interleaved: img/s from the median "
                            "round, the speed-up the geometric mean of the rounds' ratios (default: %(default)s)")
    deprecated(bench, "--timing-rounds", "--rounds", "timing_rounds", type=flag_type(ROUNDS))
    bench.add_argument("--no-timing", action="store_true", help="GMACs and accuracy only: no throughput or latency")
    bench.add_argument("--limit", type=flag_type(LIMIT), help="evaluate only the first N images")
    num_workers_flag(bench)
    bench.add_argument("--out", "--results-file", help="write the table as CSV (--results-file: timm's spelling)")
    bench.add_argument("--plot", help="write a GMACs-vs-accuracy Pareto plot (PNG)")
    bench.add_argument("--tocom", help="ToCom compensator (folder or Hub repo): adds a '+ToCom' row after each "
                                       "tome / evit row")
    bench.add_argument("--source-r", type=flag_type(SOURCE_R), default=0,
                       help="ToMe r the model was trained at (default: %(default)s)")
    bench.add_argument("--tocom-scale", type=flag_type(check_scale, float),
                       help="compensator scale s (default: the one in its config)")
    bench.add_argument("--overwrite", action="store_true", help="replace existing --out / --plot files")
    progress_flag(bench)
    bench.set_defaults(default_model="deit_tiny_patch16_224", func=run, outputs=(FILE_OUT, ("plot", "--plot", False)))


def run(args: argparse.Namespace) -> int:
    from ..commands.bench import check_plot_format, format_table, plot_pareto, run_bench, write_csv
    from ..deployment.specs import parse_methods
    from ..measure.precision import describe_settings

    if args.plot:
        check_plot_format(args.plot)  # before any work, as main() checks every output path
        if args.no_timing and not args.data:
            raise ValueError("--plot needs --data or timing: with --no-timing and random inputs there is nothing to plot")
    if random_weights(args):
        args.notes.append("no --checkpoint or --pretrained: random weights, accuracy columns are meaningless")
    rows = run_bench(
        args.model,
        methods=parse_methods(args.methods, device=args.device, dtype=args.dtype, batch_size=args.batch_size),
        checkpoint=args.checkpoint,
        pretrained=args.pretrained,
        data=args.data,
        batch_size=args.batch_size,
        device=args.device,
        timing_rounds=0 if args.no_timing else args.timing_rounds,
        limit=args.limit,
        num_workers=args.num_workers,
        show_progress=not args.no_progress,
        tocom=args.tocom,
        source_r=args.source_r,
        tocom_scale=args.tocom_scale,
        dtype=args.dtype,
        tf32=args.tf32,
        backend=args.backend,
        latency_runs=0 if args.no_timing else args.latency_runs,
    )
    timing = ("no timing" if args.no_timing else f"mode {args.backend}"
              + (f", latency: {args.latency_runs} single-image forwards" if args.latency_runs else ""))
    print(describe_settings(args.device, args.dtype, args.tf32) + f", batch {args.batch_size}, {timing}")
    print(format_table(rows))
    if args.out:
        write_csv(rows, args.out, args.model, overwrite=args.overwrite)
    if args.plot:
        plot_pareto(rows, args.plot, args.model, overwrite=args.overwrite)
    return 0
