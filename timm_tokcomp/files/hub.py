"""Hugging Face Hub access for what a user names by repo id: a snapshot (or a local folder as it is), the Hub's
reachability with the local cache as the fallback, and errors that say what to do offline."""
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from .userfiles import UserFileError


HUB_PREFIX = "hf-hub:"  # as timm spells a Hub repository: the only way to ask for a download by name


def hub_snapshot(repo_id_or_path: str, what: str, flag: Optional[str] = None, **kwargs: Any) -> Path:
    """A local folder as it is, or a Hub repository's snapshot ('hf-hub:namespace/name'; a bare 'namespace/name'
    that is no folder still reads as one, with a FutureWarning) (snapshot_download, honouring the HF cache and
    HF_HUB_OFFLINE; hub_access); a repository that cannot be fetched and is not cached is refused with what to do.
    flag: the CLI option that named it (None: a Python call, whose advice names Python arguments)."""
    asked = repo_id_or_path.startswith(HUB_PREFIX)  # the user asked for the Hub by name
    if asked:
        repo_id_or_path = repo_id_or_path[len(HUB_PREFIX):]
    path = Path(repo_id_or_path)
    if path.is_dir() and not asked:
        return path
    if path.exists() and not asked or repo_id_or_path.startswith((".", "/", "~")) or repo_id_or_path.count("/") > 1:
        raise FileNotFoundError(f"{flag + ' ' if flag else ''}{repo_id_or_path!r}: no such folder (and not a Hub "
                                f"repo id 'name' or 'namespace/name'); expected {what} folder")
    from huggingface_hub import snapshot_download

    if not asked:
        warnings.warn(f"{flag + ' ' if flag else ''}{repo_id_or_path!r} is no folder here, so it is read as a Hub "
                      f"repository; write {HUB_PREFIX}{repo_id_or_path} to ask for the Hub (a bare id that is no "
                      f"folder will be refused from the next release)", FutureWarning, stacklevel=3)
    try:
        with hub_access():
            return Path(snapshot_download(repo_id_or_path, **kwargs))
    except Exception as e:
        # 'name' and 'namespace/name' read as a relative folder too: say that there is none
        named, error = f"{flag + ' ' if flag else ''}{repo_id_or_path}", str(hub_error(e, repo_id_or_path, flag))
        raise UserFileError(f"{named}: no such folder (from {Path.cwd()}), so it was read as a Hub repo id: "
                            f"{error[len(named) + 2:] if error.startswith(named + ': ') else error}") from None


HUB_TIMEOUT_S = 3.0  # how long hub_access waits for the Hub to answer before using the local cache only


def hub_reachable(timeout: float = HUB_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the Hub's endpoint (HF_ENDPOINT) opens within timeout seconds."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout):
            return True
    except OSError:
        return False


@contextmanager
def hub_access() -> Iterator[None]:
    """Around a Hub download: when HF_HUB_OFFLINE is not set and the Hub does not answer within HUB_TIMEOUT_S, run
    the download in huggingface_hub's offline mode (the local cache only), so that an unreachable Hub fails in
    seconds with one error, not after a minute of retries and their log lines."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or hub_reachable():
        yield
        return
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    except OSError as e:
        e.hub_unreachable = True  # offline_advice says the Hub did not answer
        raise
    finally:
        constants.HF_HUB_OFFLINE = False


class HubUnreachableError(OSError):
    """A Hub download that failed with nothing cached, saying what to do instead (an OSError, as
    huggingface_hub's own download errors are)."""


def _offline(error: Exception) -> bool:
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    return isinstance(error, (LocalEntryNotFoundError, OfflineModeIsEnabled, HubUnreachableError)) \
        or "offline" in str(error).lower()


CLI_LOCAL_FILES = "--checkpoint FILE for a model's weights, a folder path for an adapter"
PYTHON_LOCAL_FILES = "a local folder path instead of the repo id"


def offline_advice(name: str, local_files: str, error: Optional[BaseException] = None) -> str:
    """'<name>: the Hub cannot be reached ...' with the ways out: the cache path, local files, HF_HUB_OFFLINE.
    error: the download's error (hub_access marks one whose Hub did not answer)."""
    from huggingface_hub import constants

    how = ("HF_HUB_OFFLINE=1 is set, so only the local cache was read" if constants.HF_HUB_OFFLINE else
           f"the Hub did not answer within {HUB_TIMEOUT_S:g} s, so only the local cache was read"
           if getattr(error, "hub_unreachable", False) else "set HF_HUB_OFFLINE=1 to skip the network retries")
    return (f"{name}: the Hub cannot be reached and this repository is not in the local cache "
            f"({constants.HF_HUB_CACHE}); download it once where there is a network, or give local files "
            f"({local_files}); {how}")


def pretrained_unreachable(error: OSError, model_name: str) -> OSError:
    """The error timm.create_model(..., pretrained=True) raises for a registered name: an unreachable Hub with
    nothing cached says what to do (HubUnreachableError); any other OSError as it was."""
    if not _offline(error):
        return error
    return HubUnreachableError(offline_advice(f"pretrained weights of {model_name}",
                                              "pretrained_cfg_overlay=dict(file=FILE) in timm.create_model, or "
                                              "--checkpoint FILE in tokcomp's commands", error))


def hub_error(error: Exception, repo_id: str, flag: Optional[str]) -> Exception:
    """The error to show for a failed Hub download: offline or unreachable with nothing cached says what to do;
    others (an unknown repo, a denied token) keep their message, naming the flag."""
    name = f"{flag + ' ' if flag else ''}{repo_id}"
    if _offline(error):
        return UserFileError(offline_advice(name, CLI_LOCAL_FILES if flag else PYTHON_LOCAL_FILES, error))
    return UserFileError(f"{name}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
