"""The `tokcomp` command line."""
import argparse
import sys
import textwrap
from typing import List, Optional

from .methods import FAMILIES, exportable_methods, tocom_methods
from .precision import AMP_NAMES


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, where it has one (not None, not an off switch) and the help does
    not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def _numbers(flag: str, text: str, kind: type) -> tuple:
    """'2,3' -> (2, 3); a ValueError naming the flag otherwise."""
    try:
        return tuple(kind(item) for item in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be a comma list of {kind.__name__}s, got {text!r}") from None


def _bench(args: argparse.Namespace) -> int:
    from .bench import check_plot_format, format_table, plot_pareto, run_bench, write_csv
    from .precision import describe_settings

    if args.plot:
        check_plot_format(args.plot)  # before any work, as main() checks every output path
        if args.no_timing and not args.data:
            raise ValueError("--plot needs --data or timing: with --no-timing and random inputs there is nothing to plot")
    if args.timing_rounds < 1:  # checked with --no-timing too: a flag's value is checked whether or not it is used
        raise ValueError(f"--timing-rounds must be >= 1 (--no-timing times nothing), got {args.timing_rounds}")
    if args.latency_runs < 0:
        raise ValueError(f"--latency-runs must be >= 0 (0: no latency), got {args.latency_runs}")
    if not args.checkpoint and not args.pretrained:
        args.notes.append("no --checkpoint or --pretrained: random weights, accuracy columns are meaningless")
    rows = run_bench(
        args.model,
        methods=args.methods.split(","),
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
    timing = ("no timing" if args.no_timing else f"backend {args.backend}"
              + (f", latency: {args.latency_runs} single-image forwards" if args.latency_runs else ""))
    print(describe_settings(args.device, args.dtype, args.tf32) + f", batch {args.batch_size}, {timing}")
    print(format_table(rows))
    if args.out:
        write_csv(rows, args.out, args.model, overwrite=args.overwrite)
    if args.plot:
        plot_pareto(rows, args.plot, args.model, overwrite=args.overwrite)
    return 0


SPEED_METHODS = "tome_r8,tome_r16,evit_r8,evit_r16"
# fused kernels against the torch path, and the proportional-attention implementations that keep SDPA's fused kernels
SPEED_METHODS_CUDA = (",tome_r8@triton,tome_r16@triton,evit_r8@triton,evit_r16@triton,tome_r16@fold,tome_r16@fold_qkv,"
                      "tome_r16@triton+fold,tome_r16@triton+fold_qkv")


def _speed(args: argparse.Namespace) -> int:
    from .precision import describe_settings, device_description
    from .speed import format_speed, run_speed, write_speed_csv

    batches = _numbers("--batches", args.batches, int)
    methods = args.methods or SPEED_METHODS + (SPEED_METHODS_CUDA if args.device.startswith("cuda") else "")
    rows = run_speed(args.model, methods=methods.split(","), batches=batches, modes=args.modes.split(","),
                     device=args.device, dtype=args.dtype, tf32=args.tf32, rounds=args.rounds,
                     checkpoint=args.checkpoint, pretrained=args.pretrained, data=args.data,
                     show_progress=not args.no_progress)
    device_name = device_description(args.device)
    print(f"{args.model} on {device_name}: {describe_settings(args.device, args.dtype, args.tf32)}, "
          f"{args.rounds} interleaved rounds")
    print(format_speed(rows))
    if args.out:
        write_speed_csv(rows, args.out, args.model, {"device": device_name, "dtype": args.dtype, "tf32": args.tf32},
                        overwrite=args.overwrite)
    return 0


def _tune(args: argparse.Namespace) -> int:
    from .bench import method_spec
    from .tuning import preset_paths, tune

    if not args.checkpoint and not args.pretrained:
        args.notes.append("no --checkpoint or --pretrained: random weights were tuned, whose agreement says nothing")
    space = None
    if args.methods is not None:
        try:
            space = [method_spec(name.strip()) for name in args.methods.split(",") if name.strip()]
        except ValueError as e:
            raise ValueError(f"--methods: {e}") from None
    result = tune(args.model, args.data, batches=list(_numbers("--batches", args.batches, int)), device=args.device,
                  dtype=args.dtype, tf32=args.tf32, budget=args.budget, budget_on=args.budget_on,
                  min_speedup=args.min_speedup,
                  modes=args.modes.split(",") if args.modes else None, space=space, checkpoint=args.checkpoint,
                  pretrained=args.pretrained, limit=args.limit, prune_images=args.prune_images,
                  max_rounds=args.max_rounds, out=args.out, resume=args.resume, overwrite=args.overwrite,
                  show_progress=not args.no_progress)
    s = result.settings
    print(f"{s['model']} on {s['device_name']}: {s['dtype']}{', TF32' if s['tf32'] else ''}, modes "
          f"{', '.join(s['modes'])}; {result.budget_text()}")
    for note in s["notes"]:
        print(f"note: {note}", file=sys.stderr)
    print(result.table())
    for batch, path in preset_paths(args.out, s["batches"]).items():
        print(f"saved {path} (batch {batch})")
    return 0


def _export(args: argparse.Namespace) -> int:
    import timm
    import torch

    from .core import apply, is_reduced
    from .models import build_base_model
    from .export import compare_onnxruntime, export_onnx
    from .methods import is_method_tag, parse_method_tag

    arch, _, last = args.model.rpartition(".")
    tagged = bool(arch) and is_method_tag(last)
    if tagged and args.method:
        raise ValueError(f"MODEL {args.model!r} already carries a method tag; drop --method or the tag")
    model = build_base_model(arch if tagged else args.model, args.checkpoint, args.pretrained, "cpu")
    tag = last if tagged else args.method
    if tag:
        method, params = parse_method_tag(tag)
        apply(model, method, **params)
    size = timm.data.resolve_model_data_config(model)["input_size"]
    torch.manual_seed(0)
    export_onnx(model, args.out, torch.randn(2, *size), overwrite=args.overwrite)
    print(f"saved {args.out} ({'plain' if not is_reduced(model) else tag}, opset 18, dynamic batch, input {size})")
    try:
        diff, shape = compare_onnxruntime(model, args.out, torch.randn(3, *size))
    except ImportError as e:
        print(f"note: not checked: {e}", file=sys.stderr)
    else:
        print(f"onnxruntime (CPU) on a random batch of 3: logits {shape}, max |ONNX - PyTorch| = {diff:.2e}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    import timm
    import torch
    from tqdm import tqdm

    from .models import build_base_model
    from .calibrate import calibrate, save_preset
    from .data import open_images

    if args.limit < 1 or args.batch_size < 1:
        raise ValueError(f"--limit and --batch-size must be >= 1, got {args.limit} and {args.batch_size}")
    if not args.checkpoint and not args.pretrained:
        args.notes.append("no --checkpoint or --pretrained: the thresholds were calibrated for random weights")
    base = build_base_model(args.model, args.checkpoint, args.pretrained, args.device)
    dataset = open_images(args.data, timm.data.create_transform(**timm.data.resolve_model_data_config(base)),
                          limit=args.limit)
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
    save_preset(result, args.out, overwrite=args.overwrite)
    print(f"saved {args.out}; compare it with `tokcomp bench {args.model} --methods none,{args.out} --data ...`")
    return 0


def _train_tocom(args: argparse.Namespace) -> int:
    import torch

    from .models import build_base_model
    from .precision import check_device
    from .tocom.train import TrainConfig, train_tocom
    from .training.engine import distributed, rank_and_world

    config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps, temperature=args.temperature, scale=args.scale, rank=args.rank,
        groups=args.groups, method=args.method, crop_scale=(args.crop_min, 1.0),
        mosaic=_numbers("--mosaic", args.mosaic, int), holdout=args.holdout,
        holdout_pick=args.holdout_pick,
        scale_grid=_numbers("--scale-grid", args.scale_grid, float),
        scale_targets=_numbers("--scale-targets", args.scale_targets, int),
        checkpoint_every=args.checkpoint_every, seed=args.seed, amp=args.amp, amp_dtype=args.amp_dtype,
        accumulate=args.accumulate)
    config.validate()
    check_device(args.device)
    if args.model_flag is not None:
        if args.model is not None:
            raise ValueError(f"give the model once: positional {args.model!r} or --model {args.model_flag!r}")
        args.notes.append("train-tocom --model MODEL is deprecated: give the model first, as every command takes it "
                          "(tokcomp train-tocom MODEL ...)")
        args.model = args.model_flag
    if args.model is None:
        raise ValueError("the model is required: tokcomp train-tocom MODEL --data DIR --out DIR")
    with distributed(args.device) as device:  # under torchrun: the process group, one GPU per process
        writer = rank_and_world()[0] == 0
        if not args.checkpoint and not args.pretrained and writer:
            args.notes.append("no --checkpoint or --pretrained: the plugins were trained for random weights")
        torch.manual_seed(args.seed)  # the same random weights in every process when there is no checkpoint
        model = build_base_model(args.model, args.checkpoint, args.pretrained, "cpu")
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


def _method_args(items: List[str]) -> dict:
    """['form=pooled', 'prop_attn=false'] -> {'form': 'pooled', 'prop_attn': False}; values are JSON or text."""
    import json

    parsed = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--method-arg must be KEY=VALUE, got {item!r}")
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    return parsed


def _finetune(args: argparse.Namespace) -> int:
    from .precision import check_device
    from .training import FinetuneConfig, finetune
    from .training.engine import distributed, rank_and_world

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


def _analyze(args: argparse.Namespace) -> int:
    from .analysis.report import run_analysis

    methods = [item.strip() for item in args.methods.split(",") if item.strip()]
    run_analysis(args.model, methods, args.data, args.out, limit=args.limit, checkpoint=args.checkpoint,
                 pretrained=args.pretrained, batch_size=args.batch_size, overlays=args.overlays, device=args.device,
                 resume=args.resume, overwrite=args.overwrite, show_progress=not args.no_progress)
    print(f"wrote {args.out}/report.md (and metrics.csv, the pictures, records/)")
    return 0


def _methods(args: argparse.Namespace) -> int:
    from .methods import METHODS, listed_tags, parameter_table

    for name, cls in METHODS.items():
        print(textwrap.fill(", ".join(cls.tag_forms()), 110, initial_indent=f"{name}\n  tags: ",
                            subsequent_indent="    "))
        if cls.tag_legend():
            print(textwrap.fill(cls.tag_legend(), 110, initial_indent="  legend: ", subsequent_indent="    "))
        print(textwrap.fill(", ".join(cls.param_names()), 110, initial_indent="  parameters: ",
                            subsequent_indent="    "))
        print(textwrap.fill(_traits(cls), 110, initial_indent="  traits: ", subsequent_indent="    "))
    print("parameters:")
    for param, default, help_, names in parameter_table():
        print(textwrap.fill(f"{help_} (default {default}; {names})", 110, initial_indent=f"  {param}: ",
                            subsequent_indent="    "))
    print(textwrap.fill("legend: <k>: r, the tokens each reducing block removes (tome_r16); <pct>: keep_rate in "
                        "percent, the share of tokens kept per reducing stage (evit_k70); low / high: the paper's "
                        "schedules. Method-specific forms are explained under their method.", 110,
                        subsequent_indent="  "))
    from .families import served_classes

    print(textwrap.fill(f"models: the tags go on the names of timm's {served_classes()} architectures, after "
                        f"their pretrained tag (timm.list_models(pretrained=True) lists "
                        f"{', '.join(listed_tags())} on each), e.g. deit_small_patch16_224.fb_in1k.tome_r16, "
                        f"vit_base_patch16_siglip_224.v2_webli.tome_r16, vit_small_patch16_dinov3.lvd1689m.tome_r16, "
                        f"eva02_base_patch14_224.mim_in22k.tome_r8, vit_pe_core_base_patch16_224.fb.tome_r8, "
                        f"vit_base_patch16_rope_mixed_224.naver_in1k.tome_r8; NaFlexVit is not served yet", 110,
                        subsequent_indent="  "))
    return 0


def _traits(cls) -> str:
    """What a method declares (TokenReducer's traits), in words."""
    traits = ["dense (keeps every token)"] if cls.dense else []
    traits.append("token counts read from the data (eager only)" if cls.data_dependent else "fixed token counts")
    traits.append("exports to ONNX" if cls.exportable() else f"no ONNX export ({cls.export_refusal})")
    traits += ["fused Triton kernels (kernel=)"] if cls.has_kernel_choice() else []
    traits += ["ToCom compensators"] if cls.tocom_compatible else []
    traits += [f"in tune's default space ({len(cls.tune_space)} settings)"] if cls.tune_space else []
    return "; ".join(traits)


def _training_flags(parser: argparse.ArgumentParser, unit: str) -> None:
    """The flags of the training engine, the same for every command that trains (stop-after counts `unit`s)."""
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    _device_flag(parser, "; under torchrun, one GPU per process")
    parser.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                        help="autocast in --amp-dtype, the trained parameters and optimizer in fp32 (default: on for "
                             "CUDA, off on the CPU)")
    parser.add_argument("--amp-dtype", choices=("bfloat16", "float16"), default="bfloat16",
                        help="autocast dtype; float16 (CUDA only) adds a gradient scaler (default: %(default)s)")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="batches per optimiser step: the global batch is --batch-size x processes x this "
                             "(default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue the run in OUT from OUT/training/checkpoint.pt")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the previous run in OUT (set aside, deleted when this run ends; a non-empty OUT "
                             "is refused without --resume or --overwrite)")
    parser.add_argument("--stop-after", type=int,
                        help=f"leave after this {unit} with a checkpoint (continue with --resume)")
    parser.add_argument("--num-workers", type=int, default=2, help="data loading workers per process "
                                                                   "(default: %(default)s)")
    _progress_flag(parser)


def _weights_flags(parser: argparse.ArgumentParser) -> None:
    """Where the model's weights come from (neither: timm's random initialisation, with a note)."""
    parser.add_argument("--checkpoint", help="weights file (.safetensors or torch) for the model")
    parser.add_argument("--pretrained", action="store_true", help="load timm's pretrained weights (Hub; offline: "
                                                                   "the HF cache with HF_HUB_OFFLINE=1)")


def _device_flag(parser: argparse.ArgumentParser, more: str = "") -> None:
    parser.add_argument("--device", default="cpu", help=f"cpu, cuda or cuda:N{more}")


def _precision_flags(parser: argparse.ArgumentParser) -> None:
    """The precision of every forward, spelled as timm's scripts do (--amp, --amp-dtype); --dtype fp32|bf16|fp16
    still works, with a deprecation note. main() resolves them into args.dtype ('fp32', 'bf16' or 'fp16')."""
    parser.add_argument("--amp", action="store_true", help="autocast every forward (evaluation and timing) to "
                                                          "--amp-dtype, as a half-precision deployment does")
    parser.add_argument("--amp-dtype", choices=("bfloat16", "float16"), default="bfloat16", help="with --amp")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                        help="deprecated spelling: --dtype bf16 is --amp, --dtype fp16 is --amp --amp-dtype float16")
    parser.add_argument("--tf32", action="store_true", help="allow TF32 matmuls on CUDA (torch's default: off)")
    parser.set_defaults(inference_precision=True)


def _resolve_precision(args: argparse.Namespace) -> str:
    """'fp32', 'bf16' or 'fp16' from --amp / --amp-dtype or the deprecated --dtype."""
    if args.dtype is None:
        return AMP_NAMES[args.amp_dtype] if args.amp else "fp32"
    if args.amp:
        raise ValueError("give --amp / --amp-dtype or the deprecated --dtype, not both")
    args.notes.append(f"--dtype is deprecated: --dtype {args.dtype} is "
                      f"{ {'fp32': 'the default (no --amp)', 'bf16': '--amp', 'fp16': '--amp --amp-dtype float16'}[args.dtype]}")
    return args.dtype


def _progress_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


# (attribute, flag, is a folder): each command's outputs, checked by main() before any work (outputs.check_output)
FILE_OUT = ("out", "--out", False)
FOLDER_OUT = ("out", "--out", True)


def build_parser() -> argparse.ArgumentParser:
    from .core import __version__
    exportable = exportable_methods()

    parser = argparse.ArgumentParser(prog="tokcomp", description="Token compression for timm ViTs.",
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"tokcomp (timm_tokcomp) {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser = sub.add_parser
    sub.add_parser = lambda *a, **k: add_parser(*a, formatter_class=_HelpFormatter, **k)  # defaults in every help
    methods = sub.add_parser("methods", help="list the methods, their name tags and their parameters")
    methods.set_defaults(func=_methods, outputs=())
    bench = sub.add_parser("bench", help="GMACs / throughput / accuracy table of several methods, side by side")
    bench.add_argument("model", nargs="?", default="deit_tiny_patch16_224",
                       help="timm architecture (default: %(default)s)")
    bench.add_argument("--methods", default="none,tome_r8,tome_r16",
                       help=f"comma list of 'none' and method tags ({FAMILIES}); default: %(default)s")
    _weights_flags(bench)
    bench.add_argument("--data", help="ImageFolder tree or folder with labels.csv (file,label): top-1 and "
                                      "agreement; a plain folder of images: agreement only; without it, "
                                      "random inputs and no accuracy")
    bench.add_argument("--batch-size", type=int, default=64)
    _device_flag(bench)
    _precision_flags(bench)
    bench.add_argument("--backend", choices=("eager", "compile", "onnx"), default="eager",
                       help="what runs the timed forwards: PyTorch eager, torch.compile, or the ONNX export in "
                            "onnxruntime (CPU, fp32; needs the export extra); default: %(default)s")
    bench.add_argument("--latency-runs", type=int, default=30,
                       help="single-image forwards timed per method for latency (median, p90; 0: none; "
                            "default: %(default)s)")
    bench.add_argument("--timing-rounds", type=int, default=5, help="timed forwards per method (median)")
    bench.add_argument("--no-timing", action="store_true", help="GMACs and accuracy only: no throughput or latency")
    bench.add_argument("--limit", type=int, help="evaluate only the first N images")
    bench.add_argument("--num-workers", type=int, default=2, help="data loading workers")
    bench.add_argument("--out", help="write the table as CSV")
    bench.add_argument("--plot", help="write a GMACs-vs-accuracy Pareto plot (PNG)")
    bench.add_argument("--tocom", help="ToCom compensator (folder or Hub repo): adds a '+ToCom' row after each "
                                       "tome / evit row")
    bench.add_argument("--source-r", type=int, default=0, help="ToMe r the model was trained at (default: %(default)s)")
    bench.add_argument("--tocom-scale", type=float, help="compensator scale s (default: the one in its config)")
    bench.add_argument("--overwrite", action="store_true", help="replace existing --out / --plot files")
    _progress_flag(bench)
    bench.set_defaults(func=_bench, outputs=(FILE_OUT, ("plot", "--plot", False)))

    cal = sub.add_parser("calibrate", help="find ATM thresholds that hit a GMACs budget on your images (no labels)")
    cal.add_argument("model", help="timm architecture, e.g. deit_tiny_patch16_224")
    target = cal.add_mutually_exclusive_group(required=True)
    target.add_argument("--target-gmacs", type=float, help="GMACs per image to reach")
    target.add_argument("--target-ratio", type=float, help="fraction of the unmodified model's GMACs, in (0, 1)")
    cal.add_argument("--data", required=True, help="folder of images (plain, labels.csv or ImageFolder; labels unused)")
    _weights_flags(cal)
    cal.add_argument("--limit", type=int, default=512, help="calibrate on the first N images (default: %(default)s)")
    cal.add_argument("--tolerance", type=float, default=0.02, help="relative GMACs tolerance (default: %(default)s)")
    cal.add_argument("--alpha", type=float, default=1.0, help="initial threshold, kept fixed (default: %(default)s)")
    cal.add_argument("--split-layer", type=int, help="blocks after it use size-distinctive matching "
                                                    "(default: three quarters of the depth)")
    cal.add_argument("--batch-size", type=int, default=64)
    _device_flag(cal)
    cal.add_argument("--num-workers", type=int, default=2, help="data loading workers")
    cal.add_argument("--out", default="atm_preset.json", help="where to save the preset (default: %(default)s)")
    cal.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    _progress_flag(cal)
    cal.set_defaults(func=_calibrate, outputs=(FILE_OUT,))

    tr = sub.add_parser("train-tocom", help="train ToCom compensator plugins by self-distillation (no labels); "
                                            "runs under torchrun --nproc_per_node=N too")
    tr.add_argument("model", nargs="?", help="timm architecture, e.g. deit_tiny_patch16_224 (required; the older "
                                             "--model spelling also works)")
    tr.add_argument("--model", dest="model_flag", help="deprecated spelling of the positional MODEL")
    _weights_flags(tr)
    tr.add_argument("--data", required=True, help="folder of images (plain, labels.csv or ImageFolder; labels unused)")
    tr.add_argument("--out", required=True, help="adapter repository folder to write (training state in OUT/training)")
    tr.add_argument("--steps", type=int, default=1100, help="optimizer steps (default: %(default)s)")
    tr.add_argument("--batch-size", type=int, default=32, help="images per step and process (default: %(default)s)")
    tr.add_argument("--lr", type=float, default=0.03, help="AdamW lr per 256 images, scaled by the global batch "
                                                           "(default: %(default)s)")
    tr.add_argument("--weight-decay", type=float, default=0.01)
    tr.add_argument("--warmup-steps", type=int, help="linear warmup before the cosine decay (default: 5%% of steps)")
    tr.add_argument("--temperature", type=float, default=1.0, help="KL softmax temperature (default: %(default)s)")
    tr.add_argument("--scale", type=float, default=0.1, help="plugin scale s during training (default: %(default)s)")
    tr.add_argument("--rank", type=int, default=2, help="LoRA rank h per projection and step (default: %(default)s)")
    tr.add_argument("--groups", type=int, default=16, help="plugins, i.e. the largest r (default: %(default)s)")
    tr.add_argument("--method", choices=tocom_methods(), default="tome", help="token reduction trained with")
    tr.add_argument("--crop-min", type=float, default=0.5, help="smallest random-crop area (default: %(default)s)")
    tr.add_argument("--mosaic", default="2,3", help="grid sizes g: each input is a g x g mosaic of crops, so small "
                                                    "images are upscaled less (1: plain crops; default: %(default)s)")
    tr.add_argument("--holdout", type=int, default=500, help="N images never trained on: held-out loss and the "
                                                             "choice of the scale (default: %(default)s)")
    tr.add_argument("--holdout-pick", choices=["spread", "end"], default="spread",
                    help="which images are held out: evenly spaced through the sorted folder, so a folder sorted by "
                         "class is held out across its classes, or its last N (default: %(default)s)")
    tr.add_argument("--scale-grid", default="0.05,0.075,0.1,0.125,0.15", help="scales tried on the held-out images")
    tr.add_argument("--scale-targets", default="4,8,12,16", help="targets r (source 0) whose mean held-out loss "
                                                                 "chooses the scale (default: %(default)s)")
    tr.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default: %(default)s)")
    _training_flags(tr, "step")
    tr.set_defaults(func=_train_tocom, outputs=(FOLDER_OUT,))

    ft = sub.add_parser("finetune", help="parameter-efficient fine-tuning on labelled images: LoRA on qkv, a new "
                                         "head and the method's own parameters (PYRA's recipe); with --distill, on "
                                         "unlabelled images, learning the unreduced model's outputs")
    ft.add_argument("model", help="timm architecture, e.g. deit_tiny_patch16_224")
    ft.add_argument("--method", default="none", help=f"token reduction trained with: a method tag ({FAMILIES}) "
                                                     f"or none (default: %(default)s)")
    ft.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="another method parameter, e.g. form=pooled (repeatable)")
    ft.add_argument("--data", required=True, help="training images: a labels.csv folder, a labels .csv file, or an "
                                                  "ImageFolder tree (with --distill also a plain image folder)")
    ft.add_argument("--eval-data", help="images evaluated after every epoch and at the end (default: --data)")
    ft.add_argument("--distill", action="store_true", help="no labels: keep the model's head and learn the unreduced "
                                                          "model's outputs (KL, temperature 1); --data may be any image "
                                                          "folder; the evaluation reports agreement with the unreduced model")
    ft.add_argument("--out", required=True, help="folder to write: peft adapter, method parameters, card, training/")
    _weights_flags(ft)
    ft.add_argument("--epochs", type=int, default=10, help="(default: %(default)s)")
    ft.add_argument("--batch-size", type=int, default=32, help="(default: %(default)s)")
    ft.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate (default: %(default)s)")
    ft.add_argument("--weight-decay", type=float, default=1e-4, help="(default: %(default)s)")
    ft.add_argument("--warmup-epochs", type=int, help="linear warm-up before the cosine decay (default: 1, or 0 "
                                                      "with --epochs 1)")
    ft.add_argument("--lora-rank", type=int, default=8, help="0: no LoRA, the backbone stays frozen and only the "
                                                             "method's parameters train (with --distill; default: "
                                                             "%(default)s)")
    ft.add_argument("--lora-alpha", type=float, help="LoRA alpha (default: the rank, i.e. scaling 1)")
    ft.add_argument("--augment", choices=("crop-flip", "none"), default="crop-flip",
                    help="random resized crops and flips, or none (default: %(default)s)")
    ft.add_argument("--crop-min", type=float, default=0.5, help="smallest random-crop area (default: %(default)s)")
    ft.add_argument("--eval-batch-size", type=int, default=64, help="(default: %(default)s)")
    _training_flags(ft, "epoch")
    ft.set_defaults(func=_finetune, outputs=(FOLDER_OUT,))

    an = sub.add_parser("analyze", help="record what several methods do to every patch, compare them with the "
                                        "study's pattern metrics, draw pictures, write a Markdown report")
    an.add_argument("model", help="timm architecture, e.g. deit_tiny_patch16_224")
    an.add_argument("--methods", default="tome_r8,evit_r8,atm",
                    help=f"comma list of two or more method tags ({FAMILIES}) or presets; default: %(default)s")
    an.add_argument("--data", required=True, help="folder of images (labels.csv, ImageFolder or plain; labels unused)")
    an.add_argument("--limit", type=int, default=256, help="first N images (default: %(default)s)")
    an.add_argument("--out", required=True, help="report folder")
    _weights_flags(an)
    an.add_argument("--batch-size", type=int, default=32)
    an.add_argument("--overlays", type=int, default=4,
                    help="images drawn with each method's groups (default: %(default)s)")
    _device_flag(an)
    an.add_argument("--resume", action="store_true", help="reuse OUT: recordings with the same settings are kept, "
                                                          "the rest is redrawn")
    an.add_argument("--overwrite", action="store_true",
                    help="replace the previous report in OUT (set aside, deleted when this run ends)")
    _progress_flag(an)
    an.set_defaults(func=_analyze, outputs=(FOLDER_OUT,))

    ex = sub.add_parser("export", help=f"write a plain or reduced model ({', '.join(exportable)}) as ONNX (dynamic "
                                       f"batch) and check it in onnxruntime")
    ex.add_argument("model", help="timm architecture, or a tagged name such as deit_tiny_patch16_224.tome_r16")
    ex.add_argument("--method", help=f"method tag of {', '.join(exportable)} (atm, ats and kmedoids do not export: "
                                     f"their token counts or round-off depend on the data)")
    _weights_flags(ex)
    ex.add_argument("--out", required=True, help="the .onnx file to write")
    ex.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    ex.set_defaults(func=_export, outputs=(FILE_OUT,))

    sp = sub.add_parser("speed", help="forward time of each method against the plain model and against its limit "
                                      "(no matching), per batch size, in eager / compiled / CUDA-graph mode")
    sp.add_argument("model", nargs="?", default="deit_tiny_patch16_224",
                    help="timm architecture (the same default as bench; the GPU tables use deit_base_patch16_224)")
    sp.add_argument("--methods", help=f"comma list of method tags ({FAMILIES}), '<tag>@<path>' "
                                      f"(a kernel, a prop_attn implementation or both: tome_r16@triton, "
                                      f"tome_r16@fold_qkv, tome_r16@triton+fold) or presets; default: "
                                      f"{SPEED_METHODS.replace(',', ', ')}, and on CUDA also "
                                      f"{SPEED_METHODS_CUDA[1:].replace(',', ', ')}")
    sp.add_argument("--batches", default="1,32,64,256", help="batch sizes (default: %(default)s)")
    sp.add_argument("--modes", default="eager", help="comma list of eager, compile (torch.compile), cudagraph "
                                                     "(torch.compile mode='reduce-overhead', CUDA only), graph (the "
                                                     "eager forward in a CUDA graph, CUDA only); default: %(default)s")
    _device_flag(sp)
    _precision_flags(sp)
    sp.add_argument("--rounds", type=int, default=20, help="timed forwards per model (median; default: %(default)s)")
    _weights_flags(sp)
    sp.add_argument("--data", help="folder of images whose first batch is timed (random inputs without it; "
                                   "adaptive methods such as ATM need real images)")
    sp.add_argument("--out", help="write the rows as CSV")
    sp.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    _progress_flag(sp)
    sp.set_defaults(func=_speed, outputs=(FILE_OUT,))
    tu = sub.add_parser("tune", help="measure the training-free methods on this device and choose the fastest that "
                                      "keeps accuracy within a budget (top-1 with labels, agreement without), or no "
                                      "reduction")
    tu.add_argument("model", help="timm architecture, e.g. deit_small_patch16_224")
    tu.add_argument("--data", required=True, help="folder of images (labels not needed; with labels top-1 is reported)")
    tu.add_argument("--out", required=True, help="folder for tune.csv, table.md, pareto.png and preset.json "
                                                 "(preset_b<B>.json per batch size when several)")
    _weights_flags(tu)
    _device_flag(tu)
    _precision_flags(tu)
    tu.add_argument("--batches", default="64", help="batch sizes, one choice each (default: %(default)s)")
    tu.add_argument("--budget", type=float, default=1.0,
                    help="the largest loss allowed on the held-out images, in points of --budget-on's measure")
    tu.add_argument("--budget-on", choices=("auto", "top1", "agreement"), default="auto",
                    help="top1: points of top-1 accuracy lost (needs labels); agreement: %% of the plain model's "
                         "predictions changed (no labels needed; several times stricter); auto: top1 when --data "
                         "is labelled")
    tu.add_argument("--min-speedup", type=float, help="choose only a candidate at least this much faster (>= 1)")
    tu.add_argument("--modes", help="execution modes to try (eager, compile, cudagraph, graph); default: eager on "
                                    "the CPU, all four on CUDA")
    tu.add_argument("--methods", help="candidate settings instead of the default space: method tags or presets, "
                                      "comma separated (each still tried on every path and mode)")
    tu.add_argument("--limit", type=int, default=512, help="images read from --data (default: %(default)s)")
    tu.add_argument("--prune-images", type=int, default=128, help="the first images, used to screen candidates; "
                                                                  "the rest decide (default: %(default)s)")
    tu.add_argument("--max-rounds", type=int, default=30, help="timed forwards per candidate at most (default: "
                                                               "%(default)s)")
    tu.add_argument("--resume", action="store_true", help="continue a killed run in --out from its tune.csv")
    tu.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out")
    _progress_flag(tu)
    tu.set_defaults(func=_tune, outputs=(FOLDER_OUT,))
    for command in sub.choices.values():  # an option without help text still shows its default
        for action in command._actions:
            if action.help is None and action.default not in (None, False, argparse.SUPPRESS):
                action.help = "(default: %(default)s)"
    return parser


def _one_line(error: Exception) -> str:
    """The error's own message: an error raised in a DataLoader worker arrives wrapped with the worker's traceback,
    whose last line is the original 'module.Type: message'."""
    text = str(error)
    if "Original Traceback" not in text:
        return text
    last = text.strip().splitlines()[-1]
    kind, sep, message = last.partition(": ")
    return message if sep and " " not in kind else last


def main(argv: Optional[List[str]] = None) -> int:
    from .training.engine import TrainingDiverged

    from .outputs import check_output

    args = build_parser().parse_args(argv)
    args.notes = []  # what qualifies the result, printed after it: an error stays the only line
    try:
        if getattr(args, "inference_precision", False):
            args.dtype = _resolve_precision(args)
        for dest, flag, folder in args.outputs:  # every output path, before any work
            if getattr(args, dest) is not None:
                check_output(getattr(args, dest), flag, getattr(args, "overwrite", False), folder=folder)
        code = args.func(args)
        for note in args.notes:
            print(f"note: {note}", file=sys.stderr)
        return code
    except (ValueError, TypeError, OSError, ImportError) as e:  # OSError: unreadable inputs, unwritable outputs
        print(f"tokcomp: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"tokcomp: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
