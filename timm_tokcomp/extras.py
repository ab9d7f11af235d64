"""Optional dependencies. The core install (torch, timm, safetensors, huggingface-hub) is enough for apply, the
registered names, bench and speed; the rest comes with an extra, and a missing one raises MissingExtra naming
the extra to install:
  tocom, train   peft (ToCom adapters, tokcomp train-tocom, tokcomp finetune)
  plot           matplotlib (bench --plot, tune's pareto.png)
  analysis       scipy, scikit-learn, matplotlib (tokcomp analyze)
  export         onnx, onnxscript, onnxruntime (tokcomp export, bench --backend onnx)
  all            every one of them
"""
import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the pip extra that installs it."""


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """import `module`, or raise MissingExtra: '<purpose> needs <package>: pip install "timm-tokcomp[<extra>]"'."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = {"sklearn": "scikit-learn"}.get(module.split(".")[0], module.split(".")[0])
        raise MissingExtra(f"{purpose} needs {package}, which the core install leaves out: "
                           f"pip install 'timm-tokcomp[{extra}]'") from None


def available(module: str) -> bool:
    """Whether `module` can be imported (an optional step is skipped without it)."""
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def pyplot(extra: str, purpose: str) -> ModuleType:
    """matplotlib.pyplot on the file-only Agg backend, or MissingExtra."""
    matplotlib = require("matplotlib", extra, purpose)
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")
