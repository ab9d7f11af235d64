"""`tokcomp speed`: forward times against the plain model and each method's limit, per batch and mode."""
import argparse

from ..methods import FAMILIES
from ..commands.speed import ROUNDS
from ..deployment.modes import check_batches
from ..utils.checks import comma_list, flag_type
from .flags import FILE_OUT, device_flag, hf_model_flag, model_flags, precision_flags, progress_flag, weights_flags


SPEED_METHODS = "tome_r8,tome_r16,evit_r8,evit_r16"
# on CUDA the bare tags run the fused kernels (kernel='auto'): the torch path beside them, and the
# proportional-attention implementations that keep SDPA's fused kernels, on either path
SPEED_METHODS_CUDA = (",tome_r8@torch,tome_r16@torch,evit_r8@torch,evit_r16@torch,tome_r16@fold,tome_r16@fold_qkv,"
                      "tome_r16@torch+fold,tome_r16@torch+fold_qkv")


def add(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("speed", help="forward time of each method against the plain model and against its limit "
                                      "(no matching), per batch size, in eager / compiled / CUDA-graph mode")
    model_flags(sp, "timm architecture (default: deit_tiny_patch16_224, as bench; the GPU tables use "
                    "deit_base_patch16_224; or --hf-model, or open_clip:ARCH)")
    sp.add_argument("--methods", help=f"comma list of method tags ({FAMILIES}), '<tag>@<path>' "
                                      f"(a kernel, a prop_attn implementation or both: tome_r16@triton, "
                                      f"tome_r16@fold_qkv, tome_r16@triton+fold) or presets; default: "
                                      f"{SPEED_METHODS.replace(',', ', ')}, and on CUDA also "
                                      f"{SPEED_METHODS_CUDA[1:].replace(',', ', ')}")
    sp.add_argument("--batches", type=flag_type(check_batches, comma_list(int)), default="1,32,64,256",
                    help="batch sizes (default: %(default)s)")
    sp.add_argument("--modes", default="eager", help="comma list of eager, compile (torch.compile), cudagraph "
                                                     "(compile with CUDA graphs, CUDA only), graph (the "
                                                     "eager forward in a CUDA graph, CUDA only); default: %(default)s")
    sp.add_argument("--torchcompile", dest="modes", action="store_const", const="compile",
                    help="timm's spelling of --modes compile")
    device_flag(sp)
    precision_flags(sp)
    sp.add_argument("--rounds", type=flag_type(ROUNDS), default=20,
                    help="timed rounds, each one forward of every model, interleaved: ms from the median, speed-ups "
                         "the geometric mean of the rounds' ratios (default: %(default)s)")
    weights_flags(sp)
    hf_model_flag(sp)
    sp.add_argument("--data", help="folder of images whose first batch is timed (random inputs without it; "
                                   "adaptive methods such as ATM need real images)")
    sp.add_argument("--out", "--results-file",
                    help="write the rows as CSV when the run ends; until then the rows so far are in OUT.partial, "
                         "rewritten after each (mode, batch), so a run stopped later keeps what it measured and OUT "
                         "is left as it was (--results-file: timm's spelling)")
    sp.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    progress_flag(sp)
    sp.set_defaults(default_model="deit_tiny_patch16_224", func=run, outputs=(FILE_OUT,))


def run(args: argparse.Namespace) -> int:
    from ..measure.precision import describe_settings, device_description
    from ..files.outputs import partial_path
    from ..deployment.specs import parse_methods
    from ..commands.speed import format_speed, run_speed, write_speed_csv

    methods = args.methods or SPEED_METHODS + (SPEED_METHODS_CUDA if args.device.startswith("cuda") else "")
    device_name = device_description(args.device)
    settings = {"device": device_name, "dtype": args.dtype, "tf32": args.tf32}

    def save(rows) -> None:  # after each (mode, batch): a run stopped later keeps what it measured, beside --out
        write_speed_csv(rows, str(partial_path(args.out)), args.model, settings, overwrite=True)

    rows = run_speed(args.model, methods=parse_methods(methods), batches=args.batches, modes=args.modes.split(","),
                     device=args.device, dtype=args.dtype, tf32=args.tf32, rounds=args.rounds,
                     checkpoint=args.checkpoint, pretrained=args.pretrained, data=args.data,
                     show_progress=not args.no_progress, on_rows=save if args.out else None)
    if args.out:  # the run ended: --out (checked before any work, cli.main) is replaced now, and the partial rows go
        write_speed_csv(rows, args.out, args.model, settings, overwrite=True)
        partial_path(args.out).unlink(missing_ok=True)
    print(f"{args.model} on {device_name}: {describe_settings(args.device, args.dtype, args.tf32)}, "
          f"{args.rounds} interleaved rounds")
    print(format_speed(rows))
    return 0
