"""The device a command is asked to run on: checked before any work, with the flag in the error."""
import torch


def check_device(device: str) -> None:
    """Raise ValueError for a device string torch cannot parse or a device this machine does not have."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    index = torch.device(device).index
    if kind == "cuda" and index is not None and index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
