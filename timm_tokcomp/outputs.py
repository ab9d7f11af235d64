"""The one writer of output files. Every file goes to a temporary name beside its target and is renamed into
place, so a crash or Ctrl-C at any moment leaves the old file or the new one, never a half-written one; and
nothing a user already has is replaced unless they asked for it (--overwrite, or --resume for a run)."""
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Union

PathLike = Union[str, Path]


@contextmanager
def replacing(path: PathLike) -> Iterator[Path]:
    """Yields a temporary path beside `path` to write to; on success it is renamed onto `path` (atomic on
    one file system), on any error or interrupt it is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: PathLike) -> dict:
    """A JSON object from a file this package wrote; ValueError naming the file when it is not valid JSON."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_versioned_json(folder: PathLike, name: str, version: int, what: str) -> dict:
    """folder/name, which marks a complete folder of `what`, with format_version `version`; ValueError otherwise."""
    path = Path(folder) / name
    if not path.is_file():
        raise ValueError(f"{folder} has no {name}: not {what}")
    data = read_json(path)
    if data.get("format_version") != version:
        raise ValueError(f"{path}: format_version {data.get('format_version')!r} is not supported "
                         f"(this version reads {version})")
    return data


def write_text(path: PathLike, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text)


def refuse_existing(path: PathLike, overwrite: bool, flag: str) -> None:
    """Raise FileExistsError when `path` exists and overwrite is False. flag: the option that named it."""
    if not overwrite and Path(path).exists():
        raise FileExistsError(f"{flag} {path} already exists; pass --overwrite to replace it")


def claim_run_folder(folder: PathLike, resume: bool, overwrite: bool, run_entries: Iterable[str]) -> None:
    """Make `folder` ready for a run that writes `run_entries` (names of files / folders) into it.

    A folder that does not exist or is empty is fine. Otherwise: resume keeps everything (the run continues
    there) but the temporary files of a killed writer; overwrite deletes the previous run's entries (and
    nothing else); neither raises FileExistsError."""
    folder = Path(folder)
    present = sorted(p.name for p in folder.iterdir() if p.name != ".lock") if folder.is_dir() else []
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"--out {folder} is a file, not a folder")
    if resume:
        for stale in folder.rglob(".*.tmp"):  # left by a run that was killed while writing
            stale.unlink()
    if not present or resume:
        return
    if not overwrite:
        shown = ", ".join(present[:4]) + (", ..." if len(present) > 4 else "")
        raise FileExistsError(f"--out {folder} is not empty ({shown}); pass --resume to continue the run in it, "
                              "--overwrite to replace it, or choose a new folder")
    for name in run_entries:
        for entry in sorted(folder.glob(name)):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


@contextmanager
def run_lock(folder: PathLike) -> Iterator[None]:
    """Hold folder/.lock (this process's id) while a run writes into folder: a second process resuming the same
    run is refused with FileExistsError instead of both writing checkpoints over each other. A lock whose
    process is gone (a killed run) is taken over."""
    path = Path(folder) / ".lock"
    created = not path.parent.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            try:
                owner = int(path.read_text() or "0")
            except (OSError, ValueError):
                owner = 0
            if owner and owner != os.getpid() and _alive(owner):
                raise FileExistsError(f"--out {folder} is in use by another run (process {owner}); wait for it or "
                                      f"choose another folder") from None
            path.unlink(missing_ok=True)  # stale: its process is gone
    else:
        raise FileExistsError(f"--out {folder}: cannot take {path}")
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        if created and not any(path.parent.iterdir()):
            path.parent.rmdir()  # a run that failed before writing anything leaves no folder behind


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
