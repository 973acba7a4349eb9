"""The package layering, read from the source: gateway -> provenance, ingest, engine;
ingest -> provenance; engine and provenance import nothing of the project's other packages.
No module may take part in an import cycle, lazy (function-level) imports included: a cycle
that only works because one side imports late still couples both sides."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "gateway", "provenance", "ingest")
ALLOWED = {
    "gateway": {"gateway", "provenance", "ingest", "engine"},
    "ingest": {"ingest", "provenance"},
    "provenance": {"provenance"},
    "engine": {"engine"},
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_imports(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The project modules `path` imports, at any depth in the file. `from a import b` counts as
    an import of `a.b` when that is a module, else of `a`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    here = module_name(path, root).split(".")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = here if is_package else here[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in modules else prefix
                     for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `import a.b.c` imports the module a.b.c
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    modules = set(files)
    return {name: project_imports(path, modules) - {name} for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    """The reader itself: a function-level import and a `from . import` both count."""
    package = tmp_path / "engine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from engine import b\n")
    (package / "b.py").write_text("from . import a\n")
    files = {module_name(p, tmp_path): p for p in package.rglob("*.py")}
    graph = {name: project_imports(path, set(files), tmp_path) - {name}
             for name, path in files.items()}
    assert cycles(graph) == [["engine.a", "engine.b"]]


def test_no_import_cycle_in_product_code():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_the_allowed_way(package):
    wrong = sorted(f"{source} imports {target}"
                   for source, targets in import_graph().items() if source.split(".")[0] == package
                   for target in targets if target.split(".")[0] not in ALLOWED[package])
    assert wrong == []
