"""Follow a model name through `tokcomp bench`, from the command down: the package's functions that take the name
or what it became (an argument equal to the name, or a module a followed call returned), in call order, outside
the forwards, as stays in rooms (a room: a module file, or with --by-folder a folder of timm_tokcomp/ as
docs/architecture.md counts them).
A return is a stay in a room the walk had already left.

    python scripts/walk_model_name.py [--by-folder] [-- bench arguments]

The default bench line is `bench deit_tiny_patch16_224 --methods none,tome_r8 --no-timing -b 2` (random weights,
no data): what a user's first command walks through."""
import argparse
import sys
from pathlib import Path
from typing import List, Tuple

from torch import nn

import timm_tokcomp
from timm_tokcomp.cli import main

PACKAGE = Path(timm_tokcomp.__file__).resolve().parent
DEFAULT = ["bench", "deit_tiny_patch16_224", "--methods", "none,tome_r8", "--no-timing", "-b", "2"]


def room_of(filename: str, by_folder: bool) -> str:
    relative = Path(filename).resolve().relative_to(PACKAGE)
    if by_folder:
        return relative.parts[0].removesuffix(".py") if len(relative.parts) > 1 else relative.stem
    return str(relative)


def walk(argv: List[str], name: str, by_folder: bool, name_only: bool = False) -> List[Tuple[str, str]]:
    """(room, function) of every call in the package that takes `name` or what it became, in call order: a call
    (anywhere: copy.deepcopy too) that takes a followed value hands its returned module on to be followed."""
    calls: List[Tuple[str, str]] = []
    followed = set()  # ids of the modules the name became
    taking = set()  # frames that took a followed value
    forwards = []  # frames of nn.Module calls running now: what a forward does is not the name's walk

    def follows(value) -> bool:
        return (isinstance(value, str) and value == name) or (isinstance(value, nn.Module) and id(value) in followed)

    def profile(frame, event, arg):
        if frame.f_code is nn.Module._call_impl.__code__:
            if event == "call":
                forwards.append(id(frame))
            elif event == "return" and forwards and forwards[-1] == id(frame):
                forwards.pop()
            return
        if forwards:
            return
        if event == "return" and id(frame) in taking:
            taking.discard(id(frame))
            if isinstance(arg, nn.Module) and not name_only:
                followed.add(id(arg))
            return
        if event != "call":
            return
        code = frame.f_code
        arguments = [frame.f_locals.get(v) for v in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]]
        if not any(follows(a) for a in arguments):
            return
        taking.add(id(frame))
        if code.co_filename.startswith(str(PACKAGE)):
            calls.append((room_of(code.co_filename, by_folder), code.co_name))

    sys.setprofile(profile)
    try:
        code = main(argv)
    finally:
        sys.setprofile(None)
    if code != 0:
        raise SystemExit(f"tokcomp {' '.join(argv)} exited {code}")
    return calls


def stays(calls: List[Tuple[str, str]]) -> List[Tuple[str, List[str]]]:
    """Consecutive calls in one room, merged: (room, its functions)."""
    merged: List[Tuple[str, List[str]]] = []
    for room, function in calls:
        if merged and merged[-1][0] == room:
            merged[-1][1].append(function)
        else:
            merged.append((room, [function]))
    return merged


def returns(walked: List[Tuple[str, List[str]]]) -> int:
    """Stays in a room the walk had already left."""
    seen, count = set(), 0
    for room, _ in walked:
        count += room in seen
        seen.add(room)
    return count


def main_walk() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--by-folder", action="store_true", help="a folder of timm_tokcomp/ is one room")
    parser.add_argument("--name-only", action="store_true", help="follow the name itself, not the models it becomes")
    parser.add_argument("bench", nargs="*", help="the bench command line (default: %(default)s)", default=DEFAULT)
    args = parser.parse_args()
    argv = args.bench if args.bench else DEFAULT
    walked = stays(walk(argv, argv[1], args.by_folder, args.name_only))
    for room, functions in walked:
        print(f"{room}: {', '.join(dict.fromkeys(functions))}")
    print(f"{len(walked)} stays, {len({room for room, _ in walked})} rooms, {returns(walked)} returns to a room "
          f"already left ({'folders' if args.by_folder else 'files'} as rooms)")
    return 0


if __name__ == "__main__":
    sys.exit(main_walk())
