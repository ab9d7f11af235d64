"""The one reader per kind of file a user hands the package (image folders and labels are in `data`): each checks
the file at the door and raises UserFileError, a ValueError whose message names the flag and the file, instead of
a traceback from deep inside a library."""
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Union

import torch
from torch import nn

from .checks import is_version

PathLike = Union[str, Path]


class UserFileError(ValueError):
    """A file given by the user that cannot be used: '<flag> <file> <what is wrong>'."""


def fail(flag: Optional[str], path: PathLike, problem: str) -> UserFileError:
    """'<flag> <path> <problem>': problem reads on from the file's name ('is not an image', ', line 3: ...')."""
    return UserFileError(f"{flag + ' ' if flag else ''}{path}{'' if problem.startswith(',') else ' '}{problem}")


def read_json(path: PathLike, flag: Optional[str] = None) -> dict:
    """A JSON object from a text file."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag + ' ' if flag else ''}{path} is missing") from None
    except UnicodeDecodeError:
        raise fail(flag, path, "is not a text file (expected JSON)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise fail(flag, path, f"is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise fail(flag, path, f"must hold a JSON object, got {type(data).__name__}")
    return data


def read_versioned_json(folder: PathLike, name: str, version: int, what: str, flag: Optional[str] = None) -> dict:
    """folder/name, which marks a complete folder of `what`, with format_version `version`."""
    path = Path(folder) / name
    if not path.is_file():
        raise fail(flag, folder, f"has no {name}: not {what}")
    data = read_json(path, flag)
    if not is_version(data.get("format_version"), version):
        raise fail(flag, path, f"format_version {data.get('format_version')!r} is not supported (this version "
                               f"reads {version})")
    return data


def read_safetensors(path: PathLike, flag: Optional[str] = None, finite: bool = True) -> Dict[str, torch.Tensor]:
    """Every tensor of a .safetensors file; truncated or corrupt files are refused, and so (finite=True: learned
    parameters, adapters) is a floating-point tensor holding NaN or inf, named with its file."""
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise FileNotFoundError(f"{flag + ' ' if flag else ''}{path} is missing")
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise fail(flag, path, f"cannot be read as safetensors ({e})") from None
    if finite:
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise fail(flag, path, f"holds NaN or inf in tensor {name!r}")
    return tensors


def check_safetensors(path: PathLike, flag: Optional[str] = None) -> None:
    """Refuse a truncated or corrupt .safetensors file from its header (which must cover the whole file), without
    reading its tensors: for files another library then loads (peft's adapter)."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise FileNotFoundError(f"{flag + ' ' if flag else ''}{path} is missing")
    try:
        with safe_open(str(path), "pt"):
            pass
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise fail(flag, path, f"cannot be read as safetensors ({e})") from None


def read_torch(path: PathLike, flag: Optional[str] = None) -> Any:
    """What torch.save wrote to a file (full unpickling: for checkpoints this package wrote, or the user's own
    weights); truncated or foreign files are refused."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{flag + ' ' if flag else ''}{path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # zip / pickle errors of a truncated or foreign file
        raise fail(flag, path, f"cannot be read as a torch checkpoint ({type(e).__name__}: {e})") from None


def read_state_dict(path: PathLike, flag: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """A model's weights from a .safetensors or torch file (a bare state dict, or one under 'state_dict' / 'model' /
    'state_dict_ema', a 'module.' prefix removed, as timm's checkpoints hold them)."""
    if str(path).endswith(".safetensors"):
        return read_safetensors(path, flag, finite=False)  # a model's own buffers may hold inf (attention masks)
    state = read_torch(path, flag)
    if isinstance(state, dict):
        for key in ("state_dict", "model", "state_dict_ema"):
            if isinstance(state.get(key), dict):
                state = state[key]
                break
    if not isinstance(state, dict) or not state or not all(torch.is_tensor(v) for v in state.values()):
        raise fail(flag, path, "holds no state dict of tensors (model weights)")
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}


def load_weights(model: nn.Module, path: PathLike, flag: str = "--checkpoint") -> None:
    """Load the weights file into model, every key and shape matching (strict)."""
    state = read_state_dict(path, flag)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mis_shaped = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or mis_shaped:
        parts = [f"{len(keys)} {what} (e.g. {', '.join(keys[:3])})" for keys, what in
                 ((missing, "missing keys"), (unexpected, "unexpected keys"), (mis_shaped, "keys of another shape"))
                 if keys]
        raise fail(flag, path, f"holds weights of another model than {type(model).__name__}: {'; '.join(parts)}")
    model.load_state_dict(state, strict=True)


def hub_snapshot(repo_id_or_path: str, what: str, flag: Optional[str] = None, **kwargs: Any) -> Path:
    """A local folder as it is, or a Hub repository's snapshot (snapshot_download, honouring the HF cache and
    HF_HUB_OFFLINE; hub_access); a repository that cannot be fetched and is not cached is refused with what to do.
    flag: the CLI option that named it (None: a Python call, whose advice names Python arguments)."""
    path = Path(repo_id_or_path)
    if path.is_dir():
        return path
    if path.exists() or repo_id_or_path.startswith((".", "/", "~")) or repo_id_or_path.count("/") > 1:
        raise FileNotFoundError(f"{flag + ' ' if flag else ''}{repo_id_or_path!r}: no such folder (and not a Hub "
                                f"repo id 'name' or 'namespace/name'); expected {what} folder")
    from huggingface_hub import snapshot_download

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
