"""The one writer of output files. Every file goes to a temporary name beside its target and is renamed into
place, so a crash or Ctrl-C at any moment leaves the old file or the new one, never a half-written one; and
nothing a user already has is replaced unless they asked for it (--overwrite, or --resume for a run). A run folder
is replaced as one transaction (run_folder): the earlier run is set aside, not deleted, until the new one ends."""
import errno
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Union

from .bounded import read_bounded

PathLike = Union[str, Path]
FILE_MODE = 0o644  # what every output file gets, whatever wrote its temporary (mkstemp-based writers give 0600)


class OutputError(OSError):
    """An output the package cannot write: '<flag> <path>: <why>' (a folder in the way, a read-only or full disk)."""


def _output_error(error: OSError, path: PathLike, flag: Optional[str]) -> OutputError:
    out = OutputError(f"{flag + ' ' if flag else ''}{path}: cannot write there ({error.strerror or error})")
    out.reason = error.strerror or str(error)
    return out


def check_output(path: PathLike, flag: str, overwrite: bool = False, folder: bool = False) -> None:
    """The one check of an output path before any work (every command, every flag that names an output):
    - a file output that exists is refused unless overwrite (FileExistsError), and one that is a folder always;
    - a folder output that is a file is refused (run_folder refuses a non-empty folder itself);
    - the path must be creatable: its nearest existing ancestor is a writable folder (probed by creating and
      removing a file there, which also catches read-only file systems where permission bits say nothing).
    Raises OutputError (an OSError) naming the flag."""
    path = Path(path)
    if path.is_dir() and not folder:
        raise OutputError(f"{flag} {path} is a folder; name a file")
    if folder and path.exists() and not path.is_dir():
        raise OutputError(f"{flag} {path} is a file, not a folder")
    if not folder:
        refuse_existing(path, overwrite, flag)
    ancestor = path if folder and path.is_dir() else path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"{flag} {path}: {ancestor} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".tokcomp-probe-", dir=ancestor)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise _output_error(e, path, flag) from None


@contextmanager
def replacing(path: PathLike, flag: Optional[str] = None) -> Iterator[Path]:
    """Yields a temporary path beside `path` to write to; on success it is renamed onto `path` (atomic on
    one file system, mode FILE_MODE), on any error or interrupt it is removed and `path` is left as it was. An
    OSError of the writing (a full disk) becomes an OutputError naming flag and path."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if path.is_symlink():
        raise OutputError(f"{flag + ' ' if flag else ''}{path} is a symbolic link; the package writes no file "
                          f"through a link (remove it, or name another path)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)  # a stale temporary (or a link planted in its name) is never written through
        yield tmp
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, (OutputError, FileExistsError)) and _under(e, path):
            raise _output_error(e, path, flag) from None
        raise


def _under(error: OSError, path: Path) -> bool:
    """Whether the error is about path, its temporary or a folder above it (not an input read meanwhile)."""
    names = [n for n in (error.filename, error.filename2) if n]
    if not names:
        return error.errno is not None and error.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
    return any(Path(path).parent == Path(n).parent or Path(path).is_relative_to(Path(n)) for n in map(str, names))


def write_text(path: PathLike, text: str, flag: Optional[str] = None) -> None:
    with replacing(path, flag) as tmp:
        tmp.write_text(text)


def refuse_existing(path: PathLike, overwrite: bool, flag: str) -> None:
    """Raise FileExistsError when `path` exists and overwrite is False. flag: the option (or parameter) that named
    it. The one rule for every finished output a user names; commands call it before their work, writers again."""
    if not overwrite and Path(path).exists():
        raise FileExistsError(f"{flag} {path} already exists; pass --overwrite to replace it")


@contextmanager
def new_output(path: PathLike, overwrite: bool = False, flag: str = "path") -> Iterator[Path]:
    """replacing(path) for a finished output a user named: an existing `path` is refused (refuse_existing) unless
    overwrite. Files inside a run folder go through run_folder's transaction instead."""
    refuse_existing(path, overwrite, flag)
    with replacing(path, flag) as tmp:
        yield tmp


def partial_path(path: PathLike) -> Path:
    """Where a command that measures in steps keeps its rows so far (F.partial beside F): F itself is replaced only
    when the run ends, so an interrupted run leaves F as it was and its finished steps in F.partial."""
    path = Path(path)
    return path.with_name(path.name + ".partial")


REPLACED = ".replaced-"  # + the writer's process id and a unique part: an earlier run set aside while a new run works


@contextmanager
def run_folder(folder: PathLike, resume: bool = False, overwrite: bool = False, run_entries: Sequence[str] = ("*",),
               kept_on_resume: Sequence[str] = ("*",), writer: bool = True, flag: str = "--out") -> Iterator[Path]:
    """Hold `folder` for a run that writes `run_entries` (glob names of files / folders) into it, as one
    transaction that never loses an earlier run's work:
    - a folder that holds something is refused (FileExistsError) unless resume or overwrite, and so is a folder
      another process is writing (folder/.lock); resume and overwrite together are refused (ValueError); a
      symbolic link anywhere below it is refused (OutputError) before any work: no read or write follows one;
    - overwrite sets the earlier run's entries aside (folder/.replaced-<pid>-<unique>/, a rename); resume does the
      same for the entries not named in kept_on_resume (those the run continues from: checkpoints, cached records);
    - the run ends without an error: what was set aside is deleted;
    - the run raises (bad input, Ctrl-C, divergence) before writing anything: the earlier entries come back as
      they were; after writing something: both stay, the new partial run in place (a resume continues it) and the
      earlier one in .replaced-<pid>-<unique>, until a run in the folder ends without an error.
    writer=False (the other processes of a distributed run): only the refusal; the writer does the rest. flag: the
    option that named the folder; a write that fails inside it (a full or read-only disk) is an OutputError naming
    it."""
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other: --resume continues the run in --out, "
                         "--overwrite replaces it with a new one; give one of them")
    folder = Path(folder)
    check_output(folder, flag, folder=True)
    present = _entries(folder, hidden=True)
    if present and not (resume or overwrite):
        shown = ", ".join(present[:4]) + (", ..." if len(present) > 4 else "")
        raise FileExistsError(f"--out {folder} is not empty ({shown}); pass --resume to continue the run in it, "
                              "--overwrite to replace it, or choose a new folder")
    if folder.is_dir():
        _refuse_links(folder, flag)
    if not writer:
        yield folder
        return
    with run_lock(folder):
        for stale in folder.rglob(".*.tmp"):  # left by a writer that was killed while writing
            stale.unlink()
        aside, moved, before = None, [], None
        try:
            for name in run_entries:
                for entry in sorted(folder.glob(name)):
                    if entry.name.startswith(".") or (resume and any(fnmatch(entry.name, k) for k in kept_on_resume)):
                        continue
                    aside = aside or Path(tempfile.mkdtemp(prefix=f"{REPLACED}{os.getpid()}-", dir=folder))
                    os.replace(entry, aside / entry.name)
                    moved.append(entry.name)
            before = _entries(folder)
            yield folder
        except BaseException as e:
            made = [p for p in folder.rglob("*") if p.name != ".lock"
                    and not p.relative_to(folder).parts[0].startswith(REPLACED)]
            if not any(p.is_file() for p in made):  # the failed run wrote no file: its empty folders go too
                for sub in sorted(made, reverse=True):
                    sub.rmdir()
            if moved and (before is None or _entries(folder) == before):  # nothing new written: put back as it was
                for name in moved:
                    os.replace(aside / name, folder / name)
                aside.rmdir()
            elif moved:
                print(f"note: {folder}'s earlier files are kept in {aside} until a run there ends without an error",
                      file=sys.stderr)
            if isinstance(e, OutputError) and not str(e).startswith(flag):
                raise OutputError(f"{flag} {folder}: cannot write there ({getattr(e, 'reason', e)})") from None
            raise
        for old in folder.glob(f"{REPLACED}*"):
            shutil.rmtree(old) if old.is_dir() else old.unlink()


def _refuse_links(folder: Path, flag: str) -> None:
    """Before a run continues or replaces what is in folder: no entry below it is a symbolic link (refused, naming
    it), so no read or write of the run follows one out of the folder. Entries the run does not write are left as
    they are (never set aside, read or overwritten)."""
    for parent, dirs, files in os.walk(folder):
        for name in sorted(dirs + files):
            entry = Path(parent) / name
            if entry.is_symlink():
                raise OutputError(f"{flag} {folder}: {entry} is a symbolic link; a run reads and writes only files "
                                  f"and folders it made (remove the link, or choose a new {flag})")


def _entries(folder: Path, hidden: bool = False) -> List[str]:
    """Names in folder (none if it does not exist): a run's entries, and with hidden an earlier run set aside."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir()
                  if not p.name.startswith(".") or (hidden and p.name.startswith(REPLACED)))


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
                owner = int(read_bounded(path, "--out", 32, "lock file (a process id)") or b"0")
            except (OSError, ValueError):  # not a lock this package wrote (a FIFO, a large file): taken over
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
