"""Optional dependencies. The core install (torch, timm, safetensors, huggingface-hub) is enough for apply, the
registered names, bench and speed; the rest comes with an extra, and a missing one raises MissingExtra naming
the extra to install:
  tocom, train   peft (ToCom adapters, tokcomp train-tocom, tokcomp finetune)
  plot           matplotlib (bench --plot, tune's pareto.png)
  analysis       scipy, scikit-learn, matplotlib (tokcomp analyze)
  export         onnx, onnxscript, onnxruntime (tokcomp export, bench --modes onnx)
  hf             transformers (its vision encoders as models to reduce; peft brings it too)
  open_clip      open-clip-torch (its image towers as models to reduce)
  all            every one of them
"""
import importlib
from pathlib import Path
from types import ModuleType

CHECKOUT = Path(__file__).resolve().parents[2]  # the source tree, when the package runs from one (pip install -e)


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the pip extra that installs it."""


def install_hint(package: str, extra: str) -> str:
    """What installs `package` for the install at hand: the package itself, and the extra that brings it with its
    companions, from the checkout this package runs from (an editable install) or by its name."""
    if (CHECKOUT / "pyproject.toml").is_file():
        return f"pip install -e '{CHECKOUT}[{extra}]' (this checkout's {extra} extra), or pip install {package}"
    return f"pip install {package} (or the {extra} extra of timm-tokcomp, from where you installed it)"


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """import `module`, or raise MissingExtra: '<purpose> needs <package>, ...: <install_hint>'."""
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        package = {"sklearn": "scikit-learn", "open_clip": "open-clip-torch"}.get(top, top)
        raise MissingExtra(f"{purpose} needs {package}, which the core install leaves out: "
                           f"{install_hint(package, extra)}") from None


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
