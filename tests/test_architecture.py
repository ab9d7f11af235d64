"""The house rules DESIGN.md sets, read from the source: nothing inside the package imports its face
(timm_tokcomp/__init__.py), no import cycle (imports inside functions count; `if TYPE_CHECKING` ones do not), and
one training loop (the only optimiser step is the engine's)."""
import ast
from pathlib import Path
from typing import Dict, List, Set

import timm_tokcomp

ROOT = Path(timm_tokcomp.__file__).parent


def _modules() -> Dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = ["timm_tokcomp", *path.relative_to(ROOT).with_suffix("").parts]
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    """The package modules `name` imports."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for branch in ast.walk(tree)
                   if isinstance(branch, ast.If) and getattr(branch.test, "id", "") == "TYPE_CHECKING"
                   for stmt in branch.body for node in ast.walk(stmt)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:  # `from . import kernels` imports the submodule, `from . import apply` the face
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {m for m in found if m in modules and m != name}


def test_no_module_imports_the_package_face():
    modules = _modules()
    importers = sorted(name for name, path in modules.items()
                       if name != "timm_tokcomp" and "timm_tokcomp" in _imports(name, path, modules))
    assert importers == []


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles: List[List[str]] = []

    def visit(name: str, trail: List[str], done: Set[str]) -> None:
        if name in trail:
            cycles.append(trail[trail.index(name):] + [name])
            return
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, trail + [name], done)
        done.add(name)

    done: Set[str] = set()
    for name in sorted(graph):
        visit(name, [], done)
    assert cycles == []


def test_the_engine_holds_the_only_optimiser_step():
    steps = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step" \
                    and "optimizer" in ast.unparse(node):
                steps.append(name)
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("optim.AdamW"):
                steps.append(name + " (AdamW)")
    assert sorted(steps) == ["timm_tokcomp.training.engine", "timm_tokcomp.training.engine (AdamW)"]


# The floors, bottom up: a module imports only from its own floor or below. A new module must be given a floor here.
FLOORS = (
    ("tensors and files", ("checks", "state", "schedules", "tables", "extras", "userfiles", "hub", "outputs", "plans", "timing",
                           "matching", "ops", "attention", "rope", "measure", "precision", "device_table", "graphs", "data", "identity",
                           "kernels")),
    ("methods", ("methods",)),
    ("models", ("regions", "handoff", "reducing", "dense", "compiling", "families", "patch", "core", "registry", "open_clip_models",
                "models", "export", "learned", "tocom", "tocom.compensator", "tocom.hub", "tocom.plugins")),
    ("kit", ("kit",)),
    ("commands", ("bench", "speed", "tuning", "calibrate", "analysis", "training", "selfcheck",
                  "kernels.selfcheck")),  # the GPU kit's name for `python -m timm_tokcomp.selfcheck`
    ("command line", ("cli",)),
)
COMMANDS = ("bench", "speed", "tuning", "calibrate", "analysis", "selfcheck", "cli")  # they stand side by side; the CLI ties them


def _longest_prefix(name: str, prefixes) -> str:
    inside = name[len("timm_tokcomp."):]
    found = [p for p in prefixes if inside == p or inside.startswith(p + ".")]
    return max(found, key=len) if found else ""


def _floor(name: str) -> int:
    """The floor a module stands on (the face above them all); -1 where FLOORS does not place it."""
    if name == "timm_tokcomp":
        return len(FLOORS)
    best = _longest_prefix(name, [p for _, prefixes in FLOORS for p in prefixes])
    return next((i for i, (_, prefixes) in enumerate(FLOORS) if best in prefixes), -1) if best else -1


def test_every_module_stands_on_a_floor_and_no_import_runs_up_a_floor():
    modules = _modules()
    assert sorted(name for name in modules if _floor(name) < 0) == []
    upward = sorted(f"{name} ({FLOORS[_floor(name)][0]}) imports {dep} ({FLOORS[_floor(dep)][0]})"
                    for name, path in modules.items() if name != "timm_tokcomp"
                    for dep in _imports(name, path, modules) if _floor(dep) > _floor(name))
    assert upward == []


def test_no_command_module_imports_a_sibling_command_except_the_cli():
    modules = _modules()
    sideways = sorted(f"{name} imports {dep}" for name, path in modules.items()
                      if _longest_prefix(name, COMMANDS) not in ("", "cli")
                      for dep in _imports(name, path, modules)
                      if _longest_prefix(dep, COMMANDS) not in ("", _longest_prefix(name, COMMANDS)))
    assert sideways == []


def test_the_floor_rules_catch_what_they_forbid():
    """The two rules above on made-up imports: a method importing the kit, the kit importing bench, speed importing
    bench."""
    assert _floor("timm_tokcomp.methods.tome") < _floor("timm_tokcomp.kit.modes") < _floor("timm_tokcomp.bench")
    assert _floor("timm_tokcomp.selfcheck") > _floor("timm_tokcomp.models") > _floor("timm_tokcomp.kernels")
    assert _longest_prefix("timm_tokcomp.speed", COMMANDS) != _longest_prefix("timm_tokcomp.bench", COMMANDS)
    assert _longest_prefix("timm_tokcomp.analysis.report", COMMANDS) == "analysis"


def _plan_kinds():
    from timm_tokcomp.plans import Plan

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    import timm_tokcomp.methods  # noqa: F401  (every method module, and the plan kinds they declare)
    return [k for k in subclasses(Plan) if k.__module__.startswith("timm_tokcomp.")]  # not the tests' toy kinds


def test_every_plan_kind_carries_itself_out():
    """Every plan kind is a Plan with its own apply: the shared kinds in timm_tokcomp/plans/, a method's own steps
    (training steps, learned merges) in its method file."""
    import inspect

    from timm_tokcomp import plans

    kinds = _plan_kinds()
    assert {k.__name__ for k in kinds} >= {"MergePlan", "PrunePlan", "ClusterPlan", "GroupPlan", "KeepMergePlan",
                                           "SoftPlan", "TruncatePlan", "ResamplePlan", "MaskPlan", "ThresholdStepPlan",
                                           "SoftMergeStepPlan", "SearchStepPlan", "PyraMergePlan", "FusionPlan",
                                           "SoftMatchPlan"}
    plans_dir = Path(plans.__file__).parent
    for kind in kinds:
        home = Path(inspect.getfile(kind))
        assert "apply" in vars(kind), f"{kind.__name__} ({home}) has no apply of its own"
        assert home.parent == plans_dir or home.parent.name == "methods", f"{kind.__name__} lives in {home}"


def test_only_plans_execute_plans():
    """No method carries out a plan (no `reduce` on a TokenReducer, no isinstance dispatch on plan kinds in the
    package), and the reducing loop calls plan.apply."""
    from timm_tokcomp.methods import METHODS

    assert sorted(cls.name for cls in METHODS.values() if any("reduce" in vars(c) for c in cls.__mro__)) == []
    names = {k.__name__ for k in _plan_kinds()} | {"Plan"}
    probes = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance" and len(node.args) == 2:
                if {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & names:
                    probes.append(f"{name}: {ast.unparse(node)}")
    assert probes == []
    loop = ast.unparse(ast.parse((ROOT / "reducing.py").read_text()))
    assert "plan.apply(x, size, source)" in loop


def test_no_module_is_over_450_lines():
    """One job per module: a module that outgrows 450 lines holds more than one (split it as tuning/ and plans/
    are split)."""
    long = {name: n for name, path in _modules().items() if (n := path.read_text().count("\n")) > 450}
    assert not long, f"modules over 450 lines: {long}"


def test_no_test_module_is_over_450_lines():
    """The tests keep the package's cap: a test module over 450 lines holds more than one subject (split it by
    subject, as test_tune.py / test_tune_choice.py are)."""
    tests = Path(__file__).resolve().parent
    long = {str(p.relative_to(tests)): n for p in tests.rglob("*.py") if (n := p.read_text().count("\n")) > 450}
    assert not long, f"test modules over 450 lines: {long}"


def test_the_tests_mirror_the_floors():
    """A test module sits in the folder of the floor it tests (tests/<floor>/), or at tests/ when it checks the
    whole package (its architecture, docs, examples, install, guarantees, public API properties)."""
    tests = Path(__file__).resolve().parent
    folders = {"tensors and files": "tensors", "methods": "methods", "models": "models", "kit": "kit",
               "commands": "commands", "command line": "cli"}
    assert [name for name, _ in FLOORS] == list(folders)
    found = {p.parent.name for p in tests.rglob("test_*.py")} - {tests.name}
    assert found == set(folders.values())
    whole = {p.name for p in tests.glob("test_*.py")}
    assert whole == {"test_architecture.py", "test_docs.py", "test_examples.py", "test_install.py",
                     "test_guarantees.py", "test_properties.py"}
