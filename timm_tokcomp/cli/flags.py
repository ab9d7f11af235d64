"""The flag groups every command shares (weights, device, precision, training, progress), the help formatter, the
outputs each command declares (checked by main before any work). Every typed flag's type is a check of
utils.checks (flag_type), the one its command's Python call runs."""
import argparse

from ..measure.precision import AMP_NAMES
from ..utils.checks import BATCH_SIZE, NUM_WORKERS, flag_type


class Parser(argparse.ArgumentParser):
    """tokcomp's parser, its subcommands' too: a command line it refuses is a ValueError, which main() prints as the
    one line every bad input gets ('tokcomp: error: argument --limit: ...'), exit 2. A missing or unknown argument
    says where the usage is, since the line replaces argparse's usage."""

    def error(self, message: str):  # type: ignore[override]
        raise ValueError(message if message.startswith("argument ") else f"{message} ({self.prog} --help shows the "
                                                                          f"usage)")


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, where it has one (not None, not an off switch) and the help does
    not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


class Deprecated(argparse.Action):
    """An old spelling kept for one release, hidden from the help: it sets the flag it stands for (dest) and main()
    prints a note naming the new spelling."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.deprecated = getattr(namespace, "deprecated", []) + [
            f"{option_string} is deprecated and goes in the next release: use {self.new}"]


def deprecated(parser: argparse.ArgumentParser, old: str, new: str, dest: str, **kwargs) -> None:
    """Accept `old` as a hidden, noted spelling of `new` (whose value is args.dest)."""
    parser.add_argument(old, dest=dest, action=Deprecated, new=new, default=argparse.SUPPRESS, **kwargs)  # the
    # default is the new flag's, whichever is declared first


def model_flags(parser: argparse.ArgumentParser, help: str) -> None:
    """MODEL, positional or as timm's scripts spell it (--model / -m); main() takes either, and refuses both."""
    parser.add_argument("model", nargs="?", metavar="MODEL", help=help)
    parser.add_argument("--model", "-m", dest="model_flag", metavar="MODEL", help="MODEL, as timm's scripts spell it")


def batch_size_flag(parser: argparse.ArgumentParser, default: int, help: str = "") -> None:
    """One batch size, spelled as timm's scripts do (-b / --batch-size)."""
    parser.add_argument("--batch-size", "-b", type=flag_type(BATCH_SIZE), default=default, help=help or None)


def num_workers_flag(parser: argparse.ArgumentParser, more: str = "") -> None:
    parser.add_argument("--num-workers", type=flag_type(NUM_WORKERS), default=2, help=f"data loading workers{more}")


def training_flags(parser: argparse.ArgumentParser, unit: str) -> None:
    """The flags of the training engine, the same for every command that trains (stop-after counts `unit`s)."""
    from ..training.config import SEED
    from ..training.engine import ACCUMULATE, AMP_DTYPES, stop_after_check

    parser.add_argument("--seed", type=flag_type(SEED.check), default=0, help="(default: %(default)s)")
    device_flag(parser, "; under torchrun, one GPU per process")
    parser.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                        help="autocast in --amp-dtype, the trained parameters and optimizer in fp32 (default: on for "
                             "CUDA, off on the CPU)")
    parser.add_argument("--amp-dtype", choices=AMP_DTYPES, default="bfloat16",
                        help="autocast dtype; float16 (CUDA only) adds a gradient scaler (default: %(default)s)")
    parser.add_argument("--accumulate", type=flag_type(ACCUMULATE), default=1,
                        help="batches per optimiser step: the global batch is --batch-size x processes x this "
                             "(default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue the run in OUT from OUT/training/checkpoint.pt")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the previous run in OUT (set aside, deleted when this run ends; a non-empty OUT "
                             "is refused without --resume or --overwrite)")
    parser.add_argument(f"--stop-after-{unit}s", dest="stop_after", type=flag_type(stop_after_check(unit)),
                        help=f"leave after this {unit} with a checkpoint (continue with --resume)")
    deprecated(parser, "--stop-after", f"--stop-after-{unit}s", "stop_after", type=flag_type(stop_after_check(unit)))
    num_workers_flag(parser, " per process")
    progress_flag(parser)


def weights_flags(parser: argparse.ArgumentParser) -> None:
    """Where the model's weights come from (neither: timm's random initialisation, with a note)."""
    parser.add_argument("--checkpoint", help="weights file (.safetensors or torch) for the model")
    parser.add_argument("--pretrained", action="store_true", help="load timm's pretrained weights (Hub; offline: "
                                                                   "the HF cache with HF_HUB_OFFLINE=1)")


def random_weights(args: argparse.Namespace) -> bool:
    """Whether the command's model keeps timm's random initialisation: no --checkpoint, no --pretrained, and MODEL
    not a transformers folder (which holds its weights)."""
    from ..models.build import is_hf_folder

    model = getattr(args, "model", None)
    return not args.checkpoint and not args.pretrained and not (isinstance(model, str) and is_hf_folder(model))


def hf_model_flag(parser: argparse.ArgumentParser) -> None:
    """A transformers model folder in place of MODEL (main() puts it there; models.build_base_model loads it)."""
    from ..families import HF_CLASSES

    parser.add_argument("--hf-model", metavar="FOLDER",
                        help=f"a transformers vision model saved with save_pretrained ({', '.join(HF_CLASSES)}; its "
                             "preprocessor_config.json gives the image transform), loaded offline, instead of MODEL; "
                             "accuracy needs ViTForImageClassification")


def device_flag(parser: argparse.ArgumentParser, more: str = "") -> None:
    parser.add_argument("--device", default="cpu", help=f"cpu, cuda or cuda:N{more}")


def precision_flags(parser: argparse.ArgumentParser) -> None:
    """The precision of every forward, spelled as timm's scripts do (--amp, --amp-dtype); --dtype fp32|bf16|fp16
    still works, with a deprecation note. main() resolves them into args.dtype ('fp32', 'bf16' or 'fp16')."""
    parser.add_argument("--amp", action="store_true", help="autocast every forward (evaluation and timing) to "
                                                          "--amp-dtype, as a half-precision deployment does")
    parser.add_argument("--amp-dtype", choices=tuple(AMP_NAMES), default="bfloat16", help="with --amp")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help=argparse.SUPPRESS)  # deprecated: bf16 is
    # --amp, fp16 is --amp --amp-dtype float16 (resolve_precision notes it)
    parser.add_argument("--tf32", action="store_true", help="allow TF32 matmuls on CUDA (torch's default: off)")
    parser.set_defaults(inference_precision=True)


def resolve_precision(args: argparse.Namespace) -> str:
    """'fp32', 'bf16' or 'fp16' from --amp / --amp-dtype or the deprecated --dtype."""
    if args.dtype is None:
        return AMP_NAMES[args.amp_dtype] if args.amp else "fp32"
    if args.amp:
        raise ValueError("give --amp / --amp-dtype or the deprecated --dtype, not both")
    args.notes.append(f"--dtype is deprecated: --dtype {args.dtype} is "
                      f"{ {'fp32': 'the default (no --amp)', 'bf16': '--amp', 'fp16': '--amp --amp-dtype float16'}[args.dtype]}")
    return args.dtype


def progress_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


# (attribute, flag, is a folder): each command's outputs, checked by main() before any work (outputs.check_output)
FILE_OUT = ("out", "--out", False)
FOLDER_OUT = ("out", "--out", True)
