"""The house rules, read from the source: the floors of docs/architecture.md (a room imports only rooms below it),
nothing inside the package imports its face (timm_tokcomp/__init__.py), no import cycle (imports inside functions
count; `if TYPE_CHECKING` ones do not), and one training loop (the only optimiser step is the engine's)."""
import ast
import re
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


# The floors: docs/architecture.md's table (floor | rooms | what lives there | tests), read here so the page and the
# rule cannot drift apart. A room is a folder of timm_tokcomp/ or a module at its top.
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
ROW = re.compile(r"^\| (\d+) \| ([^|]+) \| [^|]+ \| ([^|]+) \|$", re.M)


def floors() -> Dict[str, int]:
    """room -> floor, from docs/architecture.md ("__init__" is the face, timm_tokcomp itself)."""
    found: Dict[str, int] = {}
    for floor, rooms, _ in ROW.findall(ARCHITECTURE.read_text()):
        for room in re.findall(r"`([\w]+)`", rooms):
            assert room not in found, f"{room} stands on two floors"
            found[room] = int(floor)
    return found


def room_of(name: str) -> str:
    """The room of a module: its top folder below timm_tokcomp, its top-level module, or the face."""
    parts = name.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _floor_of(name: str, placed: Dict[str, int]) -> int:
    return placed.get(room_of(name), -1)


def test_every_room_stands_on_a_floor_and_imports_only_rooms_below_it():
    modules = _modules()
    placed = floors()
    rooms = {room_of(name) for name in modules}
    assert sorted(rooms - set(placed)) == [], "rooms docs/architecture.md does not place"
    assert sorted(set(placed) - rooms) == [], "rooms docs/architecture.md places that do not exist"
    wrong = sorted(f"{name} (floor {_floor_of(name, placed)}) imports {dep} (floor {_floor_of(dep, placed)})"
                   for name, path in modules.items() for dep in _imports(name, path, modules)
                   if room_of(dep) != room_of(name) and _floor_of(dep, placed) >= _floor_of(name, placed))
    assert wrong == []


def test_the_house_has_few_rooms_and_a_short_top_level():
    """At most 25 rooms (a folder one room) and 5 modules at the top of timm_tokcomp/."""
    rooms = {room_of(name) for name in _modules()}
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(rooms) <= 25, sorted(rooms)
    assert len(top) <= 5, top


def command_of(name: str) -> str:
    """The command a module of timm_tokcomp.commands belongs to ('' outside it; paths is shared by them all)."""
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "commands" and parts[2] != "paths" else ""


def test_no_command_imports_another_command():
    modules = _modules()
    sideways = sorted(f"{name} imports {dep}" for name, path in modules.items() if command_of(name)
                      for dep in _imports(name, path, modules) if command_of(dep) not in ("", command_of(name)))
    assert sideways == []


def test_the_floor_rules_catch_what_they_forbid():
    """The rules above on made-up imports: a method importing a command, a command importing another."""
    placed = floors()
    assert _floor_of("timm_tokcomp.methods.tome", placed) < _floor_of("timm_tokcomp.commands.bench.run", placed)
    assert _floor_of("timm_tokcomp.runtime.loop", placed) > _floor_of("timm_tokcomp.kernels.library", placed) > 0
    assert _floor_of("timm_tokcomp.nowhere", placed) == -1
    assert command_of("timm_tokcomp.commands.tune.run") != command_of("timm_tokcomp.commands.bench.run")
    assert command_of("timm_tokcomp.commands.paths") == "" == command_of("timm_tokcomp.runtime.loop")
    assert room_of("timm_tokcomp") == "__init__" and room_of("timm_tokcomp.patch") == "patch"


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
    loop = ast.unparse(ast.parse((ROOT / "runtime" / "loop.py").read_text()))
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
    """A test module sits in the folder docs/architecture.md names for its floor (tests/<folder>/), or at tests/ when
    it checks the whole package (its architecture, docs, examples, install, guarantees, public API properties)."""
    tests = Path(__file__).resolve().parent
    named = {folder.strip() for _, _, folder in ROW.findall(ARCHITECTURE.read_text())} - {"whole package"}
    found = {p.parent.name for p in tests.rglob("test_*.py")} - {tests.name}
    assert found == named
    whole = {p.name for p in tests.glob("test_*.py")}
    assert whole == {"test_architecture.py", "test_docs.py", "test_examples.py", "test_install.py",
                     "test_guarantees.py", "test_properties.py"}


def test_only_the_timm_adapter_touches_timms_private_registry():
    """timm's private registry and factory (timm.models._registry, _factory and their _-names) are read and
    patched in models/timm_names.py only: a timm release that renames them costs the registered names there
    (tests/models/test_registry.py), nothing else."""
    private = ("_registry", "_factory", "_model_entrypoints", "_model_pretrained_cfgs", "_model_has_pretrained",
               "_resolve_model_source", "_module_to_models", "_deprecated_models")
    word = re.compile(rf"\b({'|'.join(private)})\b")
    touching = sorted(name for name, path in _modules().items() if name != "timm_tokcomp.models.timm_names"
                      and word.search(path.read_text()))
    assert touching == []


def test_a_reduced_model_carries_one_state_object():
    """What timm_tokcomp keeps on a model or block is one object (runtime/state.py: model._tokcomp, ModelState or
    BlockState): no other `_tokcomp_` attribute is set or read anywhere in the package."""
    loose = re.compile(r"\._tokcomp_\w+|[\"']_tokcomp_\w+[\"']")
    found = sorted(f"{name}: {m.group(0)}" for name, path in _modules().items() if name != "timm_tokcomp.runtime.state"
                   for m in loose.finditer(path.read_text()))
    assert found == []
    assert loose.search("model._tokcomp_depth = 3") and loose.search('getattr(m, "_tokcomp_reducer")')
    assert not loose.search("model._tokcomp.depth")
