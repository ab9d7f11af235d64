"""The one writer of output files. Every file goes to a temporary name beside its target and is renamed into
place, so a crash or Ctrl-C at any moment leaves the old file or the new one, never a half-written one; and
nothing a user already has is replaced unless they asked for it (--overwrite, or --resume for a run)."""
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
    present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
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
