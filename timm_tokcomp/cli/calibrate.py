"""`tokcomp calibrate`: ATM thresholds that hit a GMACs budget on the user's images, or DyMU's per-block thresholds
for an r schedule."""
import argparse

from ..commands.calibrate import (ALPHA, LIMIT, METHODS, SPLIT_LAYER, TARGET_GMACS, TARGET_RATIO, TOLERANCE,
                                  check_r)
from ..utils.checks import flag_type
from .flags import (FILE_OUT, batch_size_flag, device_flag, model_flags, num_workers_flag, progress_flag,
                    random_weights, weights_flags)


ATM_TOLERANCE, ATM_ALPHA = 0.02, 1.0
ATM_FLAGS = (("tolerance", "--tolerance"), ("alpha", "--alpha"), ("split_layer", "--split-layer"))


def add(sub: argparse._SubParsersAction) -> None:
    cal = sub.add_parser("calibrate", help="find ATM thresholds that hit a GMACs budget, or DyMU's per-block "
                                          "thresholds, on your images (no labels)")
    model_flags(cal, "timm architecture, e.g. deit_tiny_patch16_224, or open_clip:ARCH")
    cal.add_argument("--method", choices=METHODS, default="atm",
                     help="atm: thresholds for a GMACs target (--target-gmacs / --target-ratio); dymu: DyMU's "
                          "thresholds for --r merges per image and block (default: %(default)s)")
    target = cal.add_mutually_exclusive_group()
    target.add_argument("--target-gmacs", type=flag_type(TARGET_GMACS, float), help="atm: GMACs per image to reach")
    target.add_argument("--target-ratio", type=flag_type(TARGET_RATIO, float),
                        help="atm: fraction of the unmodified model's GMACs, in (0, 1)")
    target.add_argument("--r", type=flag_type(check_r),
                        help="dymu: merges per image and block the thresholds are calibrated for")
    cal.add_argument("--data", required=True, help="folder of images (plain, labels.csv or ImageFolder; labels unused)")
    weights_flags(cal)
    cal.add_argument("--limit", type=flag_type(LIMIT), default=512,
                     help="calibrate on the first N images (default: %(default)s)")
    cal.add_argument("--tolerance", type=flag_type(TOLERANCE, float),
                     help=f"atm: relative GMACs tolerance (default: {ATM_TOLERANCE})")
    cal.add_argument("--alpha", type=flag_type(ALPHA, float),
                     help=f"atm: initial threshold, kept fixed (default: {ATM_ALPHA})")
    cal.add_argument("--split-layer", type=flag_type(SPLIT_LAYER),
                     help="atm: blocks after it use size-distinctive matching "
                          "(default: three quarters of the depth)")
    batch_size_flag(cal, 64)
    device_flag(cal)
    num_workers_flag(cal)
    cal.add_argument("--out", help="where to save the preset (default: <method>_preset.json)")
    cal.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    progress_flag(cal)
    cal.set_defaults(func=run, outputs=(FILE_OUT,))


def run(args: argparse.Namespace) -> int:
    from ..commands.calibrate import calibrate_folder, save_preset

    if args.method == "dymu" and args.r is None:
        raise ValueError("--r is needed with --method dymu (the merges per image and block to calibrate for)")
    given = [flag for name, flag in ATM_FLAGS if getattr(args, name) is not None]
    if args.method == "dymu" and given:
        raise ValueError(f"{', '.join(given)}: ATM's calibration flags (--method atm); --method dymu takes --r")
    if args.method == "atm" and args.r is not None:
        raise ValueError("--r is for --method dymu; --method atm takes --target-gmacs or --target-ratio")
    if args.method == "atm" and args.target_gmacs is None and args.target_ratio is None:
        raise ValueError("give one of --target-gmacs and --target-ratio (or --method dymu with --r)")
    out = args.out
    if out is None:  # the default path depends on --method: checked here as main() checks a given one
        from ..files.outputs import check_output

        out = f"{args.method}_preset.json"
        check_output(out, "--out", args.overwrite)
    if random_weights(args):
        args.notes.append("no --checkpoint or --pretrained: the thresholds were calibrated for random weights")
    search = dict(r=args.r) if args.method == "dymu" else dict(
        target_gmacs=args.target_gmacs, target_ratio=args.target_ratio,
        tolerance=ATM_TOLERANCE if args.tolerance is None else args.tolerance,
        alpha=ATM_ALPHA if args.alpha is None else args.alpha, split_layer=args.split_layer)
    result = calibrate_folder(args.model, args.data, args.checkpoint, args.pretrained, args.device, args.limit,
                              args.batch_size, args.num_workers, not args.no_progress, args.method, **search)
    if args.method == "dymu":
        shown = ", ".join("-" if t is None else f"{t:.4f}" for t in result.params["thresholds"])
        print(f"{args.model}: dymu thresholds per block [{shown}] (r={args.r})")
        print(f"on {result.images} images: {result.gmacs:.4f} GMACs per image ({result.gmacs / result.baseline_gmacs:.3f}x "
              f"of {result.baseline_gmacs:.4f}), agreement with the unmodified model {result.agreement:.2f}%")
        save_preset(result, out, overwrite=args.overwrite)
        print(f"saved {out}; compare it with `tokcomp bench {args.model} --methods none,{out} --data ...`")
        return 0
    p = result.params
    print(f"{args.model}: atm alpha={p['alpha']:g} beta={p['beta']:g} theta_min={p['theta_min']:.6f}"
          + ("" if p["split_layer"] is None else f" split_layer={p['split_layer']}"))
    print(f"on {result.images} images: {result.gmacs:.4f} GMACs per image ({result.gmacs / result.baseline_gmacs:.3f}x "
          f"of {result.baseline_gmacs:.4f}; target {result.target_gmacs:.4f}), agreement with the unmodified model "
          f"{result.agreement:.2f}% ({result.evaluations} evaluations)")
    save_preset(result, out, overwrite=args.overwrite)
    print(f"saved {out}; compare it with `tokcomp bench {args.model} --methods none,{out} --data ...`")
    return 0
