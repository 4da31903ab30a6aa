"""The plugin contract: the import rules of docs/design.md hold (core modules import no
plugin package, workloads import no mode, only the tracking observer's modules import
MLflow, no import cycle).  (An installed plugin cannot take a built-in's name:
test_entry_points.py.)"""

import ast
from pathlib import Path

import pytest

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
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


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
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                if module_level or getattr(child, "name", None) in skip_functions:
                    continue
            if isinstance(child, ast.If) and is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[:len(base) - child.level + 1]
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


PLUGIN_PACKAGES = ("kspipe.modes", "kspipe.reptile", "kspipe.ctr", "kspipe.datafeed",
                   "kspipe.fewshot", "kspipe.observers", "kspipe.openks")
CORE = ("pipeline", "plugin_manager", "hookspecs", "contracts", "errors", "config", "files",
        "reporting", "checkpoint", "inference", "compiling")
WORKLOADS = ("kspipe.reptile", "kspipe.ctr")
MODES = ("kspipe.modes",)


def test_the_rules_see_the_modules():
    assert {f"kspipe.{name}" for name in CORE} <= set(MODULES)
    assert any(within(m, WORKLOADS) for m in MODULES)
    builtins = imports("kspipe.plugin_manager", module_level=False)  # builtin_plugins' too
    assert any(within(name, PLUGIN_PACKAGES) for name, _ in builtins)


@pytest.mark.parametrize("name", CORE)
def test_core_modules_import_no_plugin_package(name):
    module = f"kspipe.{name}"
    if name == "plugin_manager":  # anywhere but builtin_plugins, which lists the built-ins
        found = imports(module, module_level=False, skip_functions=("builtin_plugins",))
    else:
        found = imports(module)
    bad = [f"line {line}: {imported}" for imported, line in found
           if within(imported, PLUGIN_PACKAGES)]
    assert not bad, f"{module} imports plugin packages: {bad}"


def test_workloads_import_no_mode():
    bad = [f"{module} line {line}: {imported}"
           for module in MODULES if within(module, WORKLOADS)
           for imported, line in imports(module, module_level=False)
           if within(imported, MODES)]
    assert not bad, f"workloads import modes (ask the role instead): {bad}"


def test_modes_import_no_workload_or_data_set():
    bad = [f"{module} line {line}: {imported}"
           for module in MODULES if within(module, MODES)
           for imported, line in imports(module, module_level=False)
           if within(imported, WORKLOADS + ("kspipe.datafeed", "kspipe.fewshot"))]
    assert not bad, f"modes import workloads or data sets: {bad}"


def test_nothing_outside_the_observers_imports_them_at_module_level():
    bad = [f"{module} line {line}: {imported}"
           for module in MODULES if not within(module, ("kspipe.observers",))
           for imported, line in imports(module)
           if within(imported, ("kspipe.observers",))]
    assert not bad, bad


def test_only_the_tracking_observer_imports_mlflow():
    """Only kspipe/observers/mlflow/store.py, recorder.py and serving.py import MLflow (anywhere
    in them, inside functions too), in kspipe and in the shipped plugins; each of the three
    does, so the rule sees the imports."""
    sources = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    sources += [p for p in (ROOT / "plugins").glob("*/kspipe_*/**/*.py")]
    allowed = {PACKAGE / "observers" / name for name in ("store.py", "recorder.py", "serving.py")}
    importers, bad = set(), []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            if any(within(n, ("mlflow",)) for n in names):
                importers.add(path)
                if path not in allowed:
                    bad.append(f"{path.relative_to(ROOT)} line {node.lineno}")
    assert not bad, ("only kspipe/observers/mlflow/store.py, recorder.py and serving.py may import "
                     f"mlflow: {bad}")
    assert importers == allowed, sorted(str(p.relative_to(ROOT)) for p in allowed - importers)


def import_graph() -> dict[str, set[str]]:
    """Which kspipe modules each imports, anywhere in it (inside functions too: an import
    deferred into a function is still a dependency, only a later one)."""
    return {module: {imported for imported, _ in imports(module, module_level=False)
                     if imported in MODULES and imported != module}
            for module in MODULES}


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
