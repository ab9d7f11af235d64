"""The module paths of the package before it was laid out as floors (docs/architecture.md), kept one release as
deprecated aliases: `from timm_tokcomp.speed import LimitReducer` warns (DeprecationWarning, naming the new path) and
gives timm_tokcomp.commands.speed's LimitReducer. A submodule of a moved package follows it (timm_tokcomp.tuning.run
-> timm_tokcomp.commands.tune.run). Installed by timm_tokcomp/__init__.py; the code imports the new paths only."""
import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings
from typing import Optional

# old path -> new path, below timm_tokcomp
MOVED = {
    "analysis": "commands.analyze",
    "attention": "ops.attention",
    "bench": "commands.bench",
    "calibrate": "commands.calibrate",
    "checks": "utils.checks",
    "compiling": "runtime.compile",
    "data": "files.data",
    "dense": "runtime.dense",
    "device_table": "measure.device_table",
    "export": "deployment.onnx",
    "extras": "utils.extras",
    "graphs": "runtime.graphs",
    "handoff": "runtime.handoff",
    "hub": "files.hub",
    "identity": "files.identity",
    "kernels.selfcheck": "commands.selfcheck",
    "kit": "deployment",  # its modules went to deployment/, measure/ and commands/ (below)
    "kit.agreement": "measure.agreement",
    "kit.deploy": "deployment.deploy",
    "kit.grammar": "deployment.specs",
    "kit.modes": "deployment.modes",
    "kit.paths": "commands.paths",
    "kit.presets": "deployment.presets",
    "kit.stats": "measure.stats",
    "learned": "methods.learned",
    "matching": "ops.matching",
    "open_clip_models": "models.open_clip",
    "outputs": "files.outputs",
    "precision": "measure.precision",
    "reducing": "runtime.loop",
    "regions": "runtime.regions",
    "registry": "models.timm_names",
    "rope": "ops.rope",
    "schedules": "methods.schedules",
    "selfcheck": "commands.selfcheck",
    "speed": "commands.speed",
    "state": "runtime.state",
    "tables": "utils.tables",
    "timing": "measure.timing",
    "tuning": "commands.tune",
    "userfiles": "files.userfiles",
}


_LONGEST_FIRST = sorted(MOVED, key=len, reverse=True)  # a submodule's own entry before its package's


def new_path(fullname: str) -> Optional[str]:
    """The new module path of an old one (timm_tokcomp.<old>[.<sub>]), or None when it did not move."""
    prefix = "timm_tokcomp."
    if not fullname.startswith(prefix):
        return None
    name = fullname[len(prefix):]
    for old in _LONGEST_FIRST:
        if name == old or name.startswith(old + "."):
            return prefix + MOVED[old] + name[len(old):]
    return None


class _Alias(types.ModuleType):
    """An old path: every attribute read from its new module."""

    def __init__(self, name: str, target: types.ModuleType):
        super().__init__(name, target.__doc__)
        self.__dict__["_target"] = target

    def __getattr__(self, attr: str):
        return getattr(self.__dict__["_target"], attr)

    def __dir__(self):
        return dir(self.__dict__["_target"])


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths (first on sys.meta_path) and loads each as an alias of its new module."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if new_path(fullname) else None

    def create_module(self, spec):
        new = new_path(spec.name)
        warnings.warn(f"{spec.name} moved to {new} (docs/architecture.md); the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return _Alias(spec.name, importlib.import_module(new))

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
