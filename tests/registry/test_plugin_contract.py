"""The plugin contract: the import rules of docs/design.md hold (core modules import no
plugin package, workloads import no mode, not even through the core, only the tracking
observer's modules import MLflow, no import cycle), and ``kspipe.contracts.Role`` lists
every method a workload calls on its role, which every mode's role offers.  (An installed
plugin cannot take a built-in's name: test_entry_points.py.)"""

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from kspipe import contracts

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kspipe"


# --- the import rules ---------------------------------------------------------------


def module_files() -> dict[str, Path]:
    """Every module of the kspipe package: ``{"kspipe.modes.role": path}``."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = module_files()


def is_type_checking(node) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(module: str, module_level: bool = True, skip_functions: tuple = ()) -> list:
    """``(imported module, line)`` of ``module``'s imports: at module level only (not inside
    functions; class bodies and ``if``/``try`` blocks count), or everywhere but in the
    functions named ``skip_functions``.  ``from a import b`` names ``a.b`` when that is a
    kspipe module, else ``a``."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and (
                module_level or getattr(child, "name", None) in skip_functions
            ):
                continue
            if isinstance(child, ast.If) and is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - child.level + 1]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module
                for alias in child.names:
                    full = f"{source}.{alias.name}"
                    found.append((full if full in MODULES else source, child.lineno))
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def within(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


PLUGIN_PACKAGES = (
    "kspipe.modes",
    "kspipe.reptile",
    "kspipe.ctr",
    "kspipe.datafeed",
    "kspipe.fewshot",
    "kspipe.observers",
    "kspipe.openks",
)
CORE = (
    "pipeline",
    "registry.plugin_manager",
    "registry.hookspecs",
    "contracts",
    "errors",
    "config",
    "config.schema",
    "files",
    "reporting",
    "checkpoint",
    "checkpoint.schedule",
    "checkpoint.tables",
    "checkpoint.resizing",
    "checkpoint.incremental",
    "process.stopping",
    "process.memory",
    "process.heartbeat",
    "inference",
    "compiling",
    "role",
)
WORKLOADS = ("kspipe.reptile", "kspipe.ctr")
MODES = ("kspipe.modes",)


def test_the_rules_see_the_modules():
    assert {f"kspipe.{name}" for name in CORE} <= set(MODULES)
    assert any(within(m, WORKLOADS) for m in MODULES)
    builtins = imports("kspipe.registry.plugin_manager", module_level=False)  # and its function
    assert any(within(name, PLUGIN_PACKAGES) for name, _ in builtins)


@pytest.mark.parametrize("name", CORE)
def test_core_modules_import_no_plugin_package(name):
    module = f"kspipe.{name}"
    if name == "registry.plugin_manager":  # anywhere but builtin_plugins, which lists the built-ins
        found = imports(module, module_level=False, skip_functions=("builtin_plugins",))
    else:
        found = imports(module)
    bad = [
        f"line {line}: {imported}" for imported, line in found if within(imported, PLUGIN_PACKAGES)
    ]
    assert not bad, f"{module} imports plugin packages: {bad}"


def test_workloads_import_no_mode():
    bad = [
        f"{module} line {line}: {imported}"
        for module in MODULES
        if within(module, WORKLOADS)
        for imported, line in imports(module, module_level=False)
        if within(imported, MODES)
    ]
    assert not bad, f"workloads import modes (ask the role instead): {bad}"


#: Where the core lists the built-in plugins (to register them and their config schemas):
#: the registry may name every plugin, a workload reaching it reaches no mode's code.
REGISTRY = {
    "kspipe.registry.plugin_manager": ("builtin_plugins",),
    "kspipe.config.schema": ("register_schemas",),
}


def reached(module: str, graph: dict[str, set[str]]) -> set[str]:
    """The modules ``module`` imports, anywhere in them, and those they import in turn,
    through every module but the plugin packages (a workload's own modules, the core)."""
    seen, todo = set(), [module]
    while todo:
        for imported in graph[todo.pop()] - seen:
            seen.add(imported)
            if not within(imported, PLUGIN_PACKAGES) or within(imported, WORKLOADS):
                todo.append(imported)
    return seen


def test_workloads_reach_no_mode_through_another_module():
    """A core module a workload imports (``kspipe.checkpoint.incremental``,
    ``kspipe.checkpoint`` ...) imports no mode either, not even inside a function, but where
    the registry lists the built-in plugins; the walk is seen to follow the imports."""
    graph = import_graph(skip=REGISTRY)
    bad = {
        module: sorted(m for m in reached(module, graph) if within(m, MODES))
        for module in MODULES
        if within(module, WORKLOADS)
    }
    bad = {module: modes for module, modes in bad.items() if modes}
    assert not bad, f"workloads reach modes through other modules: {bad}"
    assert "kspipe.role" in reached("kspipe.reptile.learner", graph)
    assert "kspipe.checkpoint.tables" in reached("kspipe.ctr.plugin", graph)


def test_modes_import_no_workload_or_data_set():
    bad = [
        f"{module} line {line}: {imported}"
        for module in MODULES
        if within(module, MODES)
        for imported, line in imports(module, module_level=False)
        if within(imported, WORKLOADS + ("kspipe.datafeed", "kspipe.fewshot"))
    ]
    assert not bad, f"modes import workloads or data sets: {bad}"


def test_nothing_outside_the_observers_imports_them_at_module_level():
    bad = [
        f"{module} line {line}: {imported}"
        for module in MODULES
        if not within(module, ("kspipe.observers",))
        for imported, line in imports(module)
        if within(imported, ("kspipe.observers",))
    ]
    assert not bad, bad


def test_only_the_tracking_observer_imports_mlflow():
    """Only kspipe/observers/mlflow/store.py, record.py (the recorder's process), what the
    recorder alone imports (system.py, dataset.py) and serving.py import MLflow (anywhere in
    them, inside functions too), in kspipe and in the shipped plugins; each of them does, so
    the rule sees the imports."""
    sources = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    sources += [p for p in (ROOT / "plugins").glob("*/kspipe_*/**/*.py")]
    allowed = {
        PACKAGE / "observers" / "mlflow" / name
        for name in ("store.py", "record.py", "system.py", "dataset.py", "serving.py")
    }
    importers, bad = set(), []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            if any(within(n, ("mlflow",)) for n in names):
                importers.add(path)
                if path not in allowed:
                    bad.append(f"{path.relative_to(ROOT)} line {node.lineno}")
    assert not bad, (
        f"only kspipe/observers/mlflow/store.py, record.py, system.py, dataset.py and "
        f"serving.py may import mlflow: {bad}"
    )
    assert importers == allowed, sorted(str(p.relative_to(ROOT)) for p in allowed - importers)


def import_graph(skip: dict | None = None) -> dict[str, set[str]]:
    """Which kspipe modules each imports, anywhere in it (inside functions too: an import
    deferred into a function is still a dependency, only a later one), but in the
    functions ``skip`` names (``{module: function names}``)."""
    skip = skip or {}
    return {
        module: {
            imported
            for imported, _ in imports(
                module, module_level=False, skip_functions=skip.get(module, ())
            )
            if imported in MODULES and imported != module
        }
        for module in MODULES
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_kspipe_modules_import_one_another_without_a_cycle():
    graph = import_graph()
    assert sum(len(v) for v in graph.values()) > 20  # the graph saw the imports
    assert not cycles(graph), f"import cycles among kspipe modules: {cycles(graph)}"


# --- the role contract --------------------------------------------------------------

#: Where workloads and the helpers they call ask their role for something.
ROLE_CALLERS = [
    *sorted((PACKAGE / "reptile").glob("*.py")),
    *sorted((PACKAGE / "ctr").glob("*.py")),
    *sorted((ROOT / "plugins" / "kspipe-classifier").glob("kspipe_classifier/*.py")),
    *sorted((ROOT / "tests" / "plugins" / "bags").glob("kspipe_bags/*.py")),
    *sorted((PACKAGE / "checkpoint").glob("*.py")),
]


def role_calls(path: Path) -> set[str]:
    """The attributes ``path`` takes of a role: ``role.x`` and ``<anything>.role.x``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute):
            of = node.value
            if (isinstance(of, ast.Name) and of.id == "role") or (
                isinstance(of, ast.Attribute) and of.attr == "role"
            ):
                found.add(node.attr)
    return found


def members(protocol) -> set[str]:
    """The attributes and methods a Protocol names."""
    return {name for name in vars(protocol) if not name.startswith("_")} | set(
        getattr(protocol, "__annotations__", {})
    )


def test_every_role_call_of_a_workload_is_in_the_contract():
    contract = members(contracts.Role)
    calls = {path: role_calls(path) - contract for path in ROLE_CALLERS}
    bad = {str(path.relative_to(ROOT)): sorted(names) for path, names in calls.items() if names}
    assert not bad, f"workloads call role methods that kspipe.contracts.Role lacks: {bad}"
    seen = set().union(*(role_calls(path) for path in ROLE_CALLERS))
    assert {
        "settle_tables",
        "save_tables",
        "load_tables",
        "load_table_rows",
        "parameter_sync",
        "embedding",
    } <= seen  # the walk sees the calls


#: The built-in roles: the one-process role (``mode=local``) and the distributed modes'.
ROLES = (
    "kspipe.role:Role",
    "kspipe.modes.pserver:PserverRole",
    "kspipe.modes.collective:CollectiveRole",
)


def accepts(method, wanted) -> str:
    """What ``method`` lacks of the Protocol method ``wanted``'s parameters ('' if none):
    each by name, in its place, with a default where the Protocol has one; and no more
    parameters without a default."""
    empty = inspect.Parameter.empty
    have = list(inspect.signature(method).parameters.values())
    want = list(inspect.signature(wanted).parameters.values())
    for i, parameter in enumerate(want):
        if i >= len(have) or have[i].name != parameter.name:
            return f"no parameter {parameter.name} in place {i}"
        if parameter.default is not empty and have[i].default is empty:
            return f"no default for {parameter.name}"
    extra = [
        p.name
        for p in have[len(want) :]
        if p.default is empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    return f"parameters the contract does not give: {extra}" if extra else ""


@pytest.mark.parametrize("name", ROLES)
def test_every_mode_role_offers_the_contract(name):
    module, _, attribute = name.partition(":")
    cls = getattr(importlib.import_module(module), attribute)
    missing = sorted(member for member in members(contracts.Role) if not hasattr(cls, member))
    assert not missing, f"{name} lacks {missing}"
    wrong = {
        method: accepts(getattr(cls, method), getattr(contracts.Role, method))
        for method in members(contracts.Role)
        if callable(getattr(contracts.Role, method, None))
    }
    wrong = {method: why for method, why in wrong.items() if why}
    assert not wrong, f"{name}'s methods differ from kspipe.contracts.Role: {wrong}"


def test_local_mode_and_workloads_share_the_one_process_role():
    """``mode=local`` and a learner outside a job use the core's one class, not a copy."""
    from kspipe.modes import local, role
    from kspipe.role import Role

    assert isinstance(Role(), contracts.Role)
    assert isinstance(Role().parameter_sync({}), contracts.ParameterSync)
    assert local.Role is Role and role.Role is Role
