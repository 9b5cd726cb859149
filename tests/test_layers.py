"""Layers point one way: no module imports a package above its own (docs/architecture.md), lazily inside a
function or not, and neither the package nor the benchmarks take anything from tests/. Walks the source, so a new
upward import fails here."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "weightstream"
# top to bottom: a package may import the packages after it, never one before it. The root modules (errors, units,
# the native kernels' wrappers, progress bars, the memory cgroup's reader) sit below every package.
ORDER = (
    "cli",
    "commands",
    "serve",
    "tune",
    "bench",
    "engine",
    "sim",
    "trace",
    "prefetch",
    "clock",
    "cache",
    "store",
    "io",
)
BASE = ("native", "errors", "units", "progress", "cgroup", "_native")
TEST_MODULES = {p.stem for p in (REPO / "tests").glob("*.py")}


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every absolute import of `path`, as (module, line), those inside functions included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "weightstream":  # from weightstream import native
            out += [(f"weightstream.{a.name}", node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
    return out


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "weightstream" and len(parts) > 1 else None


def _rank(package: str) -> int:
    return len(ORDER) if package in BASE or package == "__init__" else ORDER.index(package)


def upward_imports() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        own = path.relative_to(SRC).parts[0].removesuffix(".py")
        for module, line in _imports(path):
            other = _package(module)
            if other is None or other == own or other not in (*ORDER, *BASE):
                continue
            if _rank(other) < _rank(own):
                found.append(f"{path.relative_to(REPO)}:{line} imports {module} ({other} is above {own})")
    return sorted(set(found))


def test_every_package_is_in_the_order():
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in SRC.glob("*.py")} - {"__init__"}
    assert packages | modules == set(ORDER) | set(BASE) - {"_native"}  # the built extension, not a .py


def test_no_module_imports_a_package_above_its_own():
    assert upward_imports() == []


@pytest.mark.parametrize("tree", ["src", "benchmarks"])
def test_nothing_outside_tests_imports_from_tests(tree):
    found = []
    for path in sorted((REPO / tree).rglob("*.py")):
        for module, line in _imports(path):
            if module.split(".")[0] in TEST_MODULES or module.split(".")[0] == "tests":
                found.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert found == []


def test_the_walk_finds_an_upward_import(tmp_path, monkeypatch):
    """The check can fail: a store module that imports the engine is found."""
    fake = tmp_path / "weightstream"
    (fake / "store").mkdir(parents=True)
    (fake / "store" / "bad.py").write_text("def f():\n    from weightstream.engine import loader\n")
    monkeypatch.setattr(__import__(__name__), "SRC", fake)
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    assert upward_imports() == ["weightstream/store/bad.py:2 imports weightstream.engine (engine is above store)"]


# ---- no import circle, within a package or across (issue 49: store/model <-> published <-> quantize and tune's
# report <-> steps were circles inside their packages, which the order above does not see)


def module_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Each weightstream module -> the weightstream modules it imports. `from package import submodule` is an edge to
    the submodule alone: a package's __init__ runs for any of its submodules, which is no circle of the code's."""
    paths = {}
    for path in src.rglob("*.py"):
        name = ".".join(("weightstream", *path.relative_to(src).with_suffix("").parts))
        paths[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in paths.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in paths)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in paths:
                subs = {f"{node.module}.{a.name}" for a in node.names} & paths.keys()
                deps |= subs if len(subs) == len(node.names) else subs | {node.module}
        graph[name] = deps - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's, without recursion)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while not component or component[-1] != node:
                    component.append(stack.pop())
                    on_stack.discard(component[-1])
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle():
    graph = module_graph()
    assert len(graph) > 100 and "weightstream.store.model" in graph["weightstream.engine.loader"]  # it reads them
    assert circles(graph) == []


def test_a_circle_is_found():
    """The check can fail: the store's old circle (opening a published checkpoint converted it) is found."""
    graph = module_graph()
    graph["weightstream.store.model"] = graph["weightstream.store.model"] | {"weightstream.store.convert"}
    assert ["weightstream.store.convert", "weightstream.store.model", "weightstream.store.quant.pipeline"] in circles(
        graph
    )


def test_ray_imports_only_serve():
    """serve --ray's replicas run serve's own app: serve/ray takes nothing from the engine or the commands."""
    wrong = {
        (name, dep)
        for name, deps in module_graph().items()
        if name.startswith("weightstream.serve.ray")
        for dep in deps
        if not dep.startswith("weightstream.serve") and _package(dep) not in BASE
    }
    assert wrong == set()
