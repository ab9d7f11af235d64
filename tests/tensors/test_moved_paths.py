"""The module paths from before the package was laid out as floors (timm_tokcomp/_moved.py) work for one release:
each old path imports, warns with a DeprecationWarning naming its new path, and gives the new module's objects;
the shared GPU kit's imports among them."""
import subprocess
import sys

SCRIPT = """
import importlib, warnings
from timm_tokcomp._moved import MOVED
for old, new in sorted(MOVED.items()):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = importlib.import_module("timm_tokcomp." + old)
    said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any(f"timm_tokcomp.{old} moved to timm_tokcomp.{new}" in s for s in said), (old, said)
    target = importlib.import_module("timm_tokcomp." + new)
    public = [n for n in vars(target) if not n.startswith("_")]  # a package's __init__ may hold none
    assert alias.__doc__ == target.__doc__ and all(getattr(alias, n) is getattr(target, n) for n in public), old
from timm_tokcomp.speed import LimitReducer, limit_schedule  # the GPU kit's imports
from timm_tokcomp.commands.speed import LimitReducer as new
assert LimitReducer is new and callable(limit_schedule)
from timm_tokcomp.tuning.run import tune  # a submodule of a moved package follows it
from timm_tokcomp.commands.tune.run import tune as new_tune
assert tune is new_tune
print("ok", len(MOVED))
"""


def test_every_old_module_path_warns_and_gives_the_new_modules_objects():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-3000:]


def test_a_path_that_did_not_move_is_not_an_alias():
    from timm_tokcomp._moved import new_path

    assert new_path("timm_tokcomp.speed") == "timm_tokcomp.commands.speed"
    assert new_path("timm_tokcomp.tuning.run") == "timm_tokcomp.commands.tune.run"
    assert new_path("timm_tokcomp.commands.speed") is None and new_path("timm_tokcomp.patch") is None
    assert new_path("timm.models") is None
