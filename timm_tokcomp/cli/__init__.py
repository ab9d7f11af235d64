"""The `tokcomp` command line: one module per command (its flags beside its handler), the shared flag groups in
`flags`; main() parses, checks every output path, runs the command and turns bad input into one error line."""
import argparse
import sys
from typing import List, Optional

from . import analyze, bench, calibrate, export, finetune, methods, speed, train_tocom, tune, vlm
from .flags import HelpFormatter, Parser, resolve_precision

COMMANDS = (methods, bench, calibrate, train_tocom, finetune, analyze, export, speed, tune, vlm)  # the order --help lists


def build_parser() -> argparse.ArgumentParser:
    from ..core import __version__

    parser = Parser(prog="tokcomp", description="Token compression for timm ViTs.", formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"tokcomp (timm_tokcomp) {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser = sub.add_parser
    sub.add_parser = lambda *a, **k: add_parser(*a, formatter_class=HelpFormatter, **k)  # defaults in every help
    for command in COMMANDS:
        command.add(sub)
    for command in sub.choices.values():  # MODEL, however it is given, first; required unless a default stands in
        if any(a.dest == "model" and not a.option_strings for a in command._actions):
            hf = any(a.dest == "hf_model" for a in command._actions)
            given = "MODEL | --model MODEL" + (" | --hf-model FOLDER" if hf else "")
            optional = command.get_default("default_model") is not None
            command.usage = f"%(prog)s {'[' if optional else '('}{given}{']' if optional else ')'} [options]"
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
    from ..training.engine import TrainingDiverged

    from ..models.build import HFFolder, is_hf_folder
    from ..files.outputs import check_output
    from ..measure.precision import check_device

    try:
        args = build_parser().parse_args(argv)
    except ValueError as e:  # a refused command line (Parser.error): a typed flag's words are its check's
        print(f"tokcomp: error: {e}", file=sys.stderr)
        return 2
    args.notes = list(getattr(args, "deprecated", []))  # what qualifies the result, printed after it: an error stays
    # the only line
    try:
        if getattr(args, "model_flag", None) is not None:  # --model / -m, as timm's scripts spell MODEL
            if args.model is not None and args.model != args.model_flag:
                raise ValueError(f"give MODEL once: positional {args.model!r} or --model {args.model_flag!r}")
            args.model = args.model_flag
        if getattr(args, "hf_model", None) is not None:  # a transformers model folder stands for MODEL
            if args.model is not None:
                raise ValueError(f"give MODEL or --hf-model FOLDER, not both (MODEL {args.model!r}, --hf-model "
                                 f"{args.hf_model})")
            args.model = HFFolder(args.hf_model)
            if not is_hf_folder(args.model):
                raise FileNotFoundError(f"--hf-model {args.hf_model}: not a folder saved by save_pretrained "
                                        "(no config.json in it)")
        elif getattr(args, "model", None) is None and getattr(args, "default_model", None):
            args.model = args.default_model
        if hasattr(args, "model") and args.model is None:
            other = " or --hf-model FOLDER" if hasattr(args, "hf_model") else ""
            raise ValueError(f"give MODEL (a timm architecture, or open_clip:ARCH): first, or as --model / -m{other}")
        if getattr(args, "inference_precision", False):
            args.dtype = resolve_precision(args)
        if isinstance(getattr(args, "device", None), str):  # one device check for every command, before any work
            check_device(args.device)
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
    except KeyboardInterrupt:  # Ctrl-C: one line saying what the run kept, and the shell's code for SIGINT
        print(f"tokcomp: interrupted; {_kept(args)}", file=sys.stderr)
        return 130


def _kept(args: argparse.Namespace) -> str:
    """What an interrupted command left, from its declared outputs: the rows it measured so far (F.partial beside
    --out F), a run folder to continue with --resume, or nothing."""
    from pathlib import Path

    from ..files.outputs import partial_path

    kept = []
    for dest, flag, folder in getattr(args, "outputs", ()):
        value = getattr(args, dest, None)
        if value is None:
            continue
        if folder and Path(value).is_dir() and any(p.is_file() and not p.name.startswith(".")
                                                   for p in Path(value).rglob("*")):
            more = " (continue it with --resume)" if hasattr(args, "resume") else ""
            kept.append(f"the run so far is in {flag} {value}{more}")
        elif not folder and partial_path(value).is_file():
            kept.append(f"the rows measured so far are in {partial_path(value)} ({flag} {value} is as it was)")
    return "; ".join(kept) if kept else "nothing was written"
