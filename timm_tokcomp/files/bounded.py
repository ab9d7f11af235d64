"""The door every file the package reads passes through, bounded before it costs (docs/guarantees.md, "Bounds"):
- only a regular file is opened: a FIFO, device or socket is refused from its stat, before it is opened (nothing
  hangs; a link to /dev/zero reads nothing);
- at most a stated number of bytes is read (MAX_TEXT_BYTES, MAX_JSON_BYTES);
- JSON is parsed only within MAX_JSON_DEPTH levels of nesting and MAX_NUMBER_CHARS characters a number (checked
  on the text before the parser runs, so Python's recursion and 4,300-digit limits are never reached);
- a zip archive (a torch checkpoint, an .npz recording) is checked from its directory, and an .npy member from
  its array header, before anything is decompressed: what the members declare must be what they hold, and within
  what the reader allows.
Every refusal is a UserFileError naming the flag (or call) that brought the file and the file itself."""
import json
import os
import re
import stat
import zipfile
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np

PathLike = Union[str, Path]

MAX_TEXT_BYTES = 64 << 20  # a labels.csv or tune.csv: 64 MiB, some million rows
MAX_JSON_BYTES = 16 << 20  # presets, configs, recipes: a few kB; a Hub config.json a few hundred
MAX_JSON_DEPTH = 64  # levels of [ and {; the package's files nest 4 deep, transformers' configs 6
MAX_NUMBER_CHARS = 100  # characters of one JSON number (Python's int() stops at 4,300 digits, not naming the file)
TORCH_ZIP_RATIO = 4  # a torch checkpoint's members may unpack to at most 4x the file (torch.save stores, not deflates)
_NPY_HEADER_BYTES = 1 << 16  # the most an .npy member's header may take (numpy writes 128 bytes)


class UserFileError(ValueError):
    """A file given by the user that cannot be used: '<flag> <file> <what is wrong>'."""


def fail(flag: Optional[str], path: PathLike, problem: str) -> UserFileError:
    """'<flag> <path> <problem>': problem reads on from the file's name ('is not an image', ', line 3: ...')."""
    return UserFileError(f"{flag + ' ' if flag else ''}{path}{'' if problem.startswith(',') else ' '}{problem}")


def missing(flag: Optional[str], path: PathLike) -> FileNotFoundError:
    return FileNotFoundError(f"{flag + ' ' if flag else ''}{path} is missing")


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def regular_file(path: PathLike, flag: Optional[str] = None) -> int:
    """The size in bytes of the regular file at path (a link is followed); FileNotFoundError where there is none,
    UserFileError for a FIFO, device, socket or folder, from its stat alone: nothing is opened."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise missing(flag, path) from None
    except OSError as e:  # a name too long, a loop of links, no permission
        raise fail(flag, path, f"cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(info.st_mode):
        kind = next((what for test, what in _KINDS if test(info.st_mode)), "not a regular file")
        raise fail(flag, path, f"is {kind}, not a regular file: only regular files are read")
    return info.st_size


def read_bounded(path: PathLike, flag: Optional[str], max_bytes: int, what: str) -> bytes:
    """The bytes of the regular file at path, refused (naming `what` it should be) beyond max_bytes, before they
    are read. The file is opened without blocking and checked again once open, so a file swapped for a FIFO
    between the stat and the open cannot hang the reader."""
    size = regular_file(path, flag)
    if size > max_bytes:
        raise fail(flag, path, f"is {size:,} bytes, over the {max_bytes:,} a {what} may take")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise fail(flag, path, "is not a regular file: only regular files are read")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # it grew since the stat
        raise fail(flag, path, f"is over the {max_bytes:,} bytes a {what} may take")
    return data


def read_text(path: PathLike, flag: Optional[str], what: str, max_bytes: int = MAX_TEXT_BYTES,
              encoding: str = "utf-8") -> str:
    """The text of a regular file of at most max_bytes; a file that is no text is refused naming `what` it
    should be."""
    try:
        return read_bounded(path, flag, max_bytes, what).decode(encoding)
    except UnicodeDecodeError:
        raise fail(flag, path, f"is not a text file (expected {what})") from None


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d.eE+-]*")


def json_bounds(text: str) -> Optional[str]:
    """What makes JSON text exceed the bounds (nesting, a number's length), or None. Strings are set aside first, so
    brackets and digits inside them do not count; linear in the text."""
    bare = _STRING.sub('""', text)
    codes = np.frombuffer(bare.encode("utf-8", "surrogatepass"), dtype=np.uint8)
    steps = (np.isin(codes, (ord("["), ord("{"))).astype(np.int32) - np.isin(codes, (ord("]"), ord("}"))))
    depth = int(steps.cumsum().max(initial=0))
    if depth > MAX_JSON_DEPTH:
        return f"is nested {depth:,} levels deep, over the {MAX_JSON_DEPTH} JSON may nest here"
    longest = max((len(m) for m in _NUMBER.findall(bare)), default=0)
    if longest > MAX_NUMBER_CHARS:
        return f"holds a number of {longest:,} characters, over the {MAX_NUMBER_CHARS} a JSON number may take here"
    return None


def loads_json(text: str, flag: Optional[str], source: PathLike) -> Any:
    """JSON text (a file's, or a flag's value: source names it), within the bounds; UserFileError otherwise."""
    problem = json_bounds(text)
    if problem is not None:
        raise fail(flag, source, problem)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise fail(flag, source, f"is not valid JSON ({e})") from None


def read_json(path: PathLike, flag: Optional[str] = None) -> dict:
    """A JSON object from a regular text file of at most MAX_JSON_BYTES, within the bounds."""
    data = loads_json(read_text(path, flag, "JSON file", MAX_JSON_BYTES), flag, path)
    if not isinstance(data, dict):
        raise fail(flag, path, f"must hold a JSON object, got {type(data).__name__}")
    return data


def check_torch_zip(path: PathLike, flag: Optional[str] = None) -> None:
    """Refuse, from the archive's directory alone, a torch checkpoint whose members declare more than
    TORCH_ZIP_RATIO times the file (torch.save stores its members, so they unpack to the file's size): a few MB of
    compressed zeros must not unpack to gigabytes. A file that is no zip (torch's legacy format) passes to
    torch.load, which refuses what it cannot read."""
    size = regular_file(path, flag)
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            declared = sum(info.file_size for info in archive.infolist())
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise fail(flag, path, f"cannot be read as a torch checkpoint (its zip directory: {e})") from None
    if declared > TORCH_ZIP_RATIO * size + (1 << 20):
        raise fail(flag, path, f"is a {size:,}-byte archive whose members unpack to {declared:,} bytes (over "
                               f"{TORCH_ZIP_RATIO}x the file; torch.save does not compress): refused before "
                               "decompressing it")


def npz_shapes(path: PathLike, max_bytes: int,
               flag: Optional[str] = None) -> Dict[str, Tuple[Tuple[int, ...], np.dtype]]:
    """{member name without .npy: (shape, dtype)} of an .npz archive, read from its directory and each array's
    header, nothing decompressed beyond the headers. Refused when a header declares another size than its member
    unpacks to, an object array, or all arrays together more than max_bytes."""
    regular_file(path, flag)
    shapes, total = {}, 0
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if not info.filename.endswith(".npy"):
                    raise fail(flag, path, f"holds {info.filename!r}, which is no array (.npy)")
                with archive.open(info) as member:
                    shape, dtype = _npy_header(member)
                nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
                if dtype.hasobject or nbytes > info.file_size:
                    raise fail(flag, path, f"member {info.filename!r} declares a {shape} {dtype} array "
                                           f"({nbytes:,} bytes) in {info.file_size:,} bytes: refused before reading")
                total += nbytes
                shapes[info.filename[:-len(".npy")]] = (shape, dtype)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        if isinstance(e, UserFileError):
            raise
        raise fail(flag, path, f"cannot be read as an .npz archive ({type(e).__name__}: {e})") from None
    if total > max_bytes:
        raise fail(flag, path, f"declares arrays of {total:,} bytes, over the {max_bytes:,} this reader allows")
    return shapes


def _npy_header(member: Any) -> Tuple[Tuple[int, ...], np.dtype]:
    """(shape, dtype) from the start of an .npy stream, its header at most _NPY_HEADER_BYTES."""
    version = np.lib.format.read_magic(member)
    if version not in ((1, 0), (2, 0)):  # what numpy writes
        raise ValueError(f"npy format version {version} is not read")
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(member, max_header_size=_NPY_HEADER_BYTES)
    return tuple(int(n) for n in shape), dtype
