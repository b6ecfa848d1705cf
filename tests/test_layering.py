"""The package's layering, checked from the source: who may import what.

- no name starting with ``_`` is imported from another module of the library;
- the private modules of a package are imported only inside it: other packages go
  through the package's face (``from metaq.protocol import ...``; a private package
  such as ``metaq._zk`` has a face too);
- ``zk_layout`` does not import ``metaq``;
- no import cycle between modules at import time (imports inside functions and under
  ``TYPE_CHECKING`` are not import-time edges);
- every module has a docstring saying what it holds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("metaq", "zk_layout")
#: private modules every package may import directly: the error tree, the named
#: shapes, the one place that builds kazoo clients (httpx's ``_exceptions``/
#: ``_config`` in spirit) and the one durable file write (broker and consumer)
SHARED = {"metaq._errors", "metaq._zkclient", "metaq._types", "metaq._durable"}


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _package(module: str) -> str:
    """The package a module belongs to: itself for a package's face."""
    if (ROOT / module.replace(".", "/")).is_dir():
        return module
    return module.rsplit(".", 1)[0]


def _imports(path: Path, *, import_time: bool):
    """(line, module, names) of ``from metaq... import names``; with ``import_time``
    only those executed when the module is imported."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    if import_time:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                    isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
                skip.update(id(n) for n in ast.walk(node) if n is not node or
                            not isinstance(node, ast.If))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] in PACKAGES:
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES:
                    yield node.lineno, a.name, []


def _target(module: str, name: str) -> str:
    """``from module import name``: the module imported, when ``name`` is one."""
    return f"{module}.{name}" if f"{module}.{name}" in MODULES else module


def test_no_private_name_crosses_a_module_boundary():
    bad = []
    for path in MODULES.values():
        for line, source, names in _imports(path, import_time=False):
            for name in names:
                if name.startswith("_") and not name.startswith("__") and \
                        f"{source}.{name}" not in MODULES:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {name} from {source}")
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)


def test_private_modules_are_imported_only_inside_their_package():
    bad = []
    for module, path in MODULES.items():
        here = _package(module)
        for line, source, names in _imports(path, import_time=False):
            for target in {_target(source, n) for n in names} | {source}:
                if target in SHARED or target not in MODULES or _package(target) == target:
                    continue  # a package's face, even a private package's, is its door
                tail = target.split(".")[-1]
                owner = _package(target)
                if tail.startswith("_") and not tail.startswith("__") and \
                        not (here == owner or here.startswith(owner + ".")):
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {target}")
    assert not bad, "private modules imported from outside their package:\n" + "\n".join(bad)


def test_zk_layout_does_not_import_metaq():
    bad = [f"{path.relative_to(ROOT)}:{line}: {source}"
           for module, path in MODULES.items() if module.startswith("zk_layout")
           for line, source, _ in _imports(path, import_time=False)
           if source.split(".")[0] == "metaq"]
    assert not bad, bad


def test_no_import_cycle_at_import_time():
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = edges.setdefault(module, set())
        for _line, source, names in _imports(path, import_time=True):
            for target in {_target(source, n) for n in names} or {source}:
                # importing a.b.c runs a and a.b first: the faces are edges too,
                # except a package's own face seen from inside it
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    step = ".".join(parts[:i])
                    if step in MODULES and step != module and not module.startswith(step + "."):
                        targets.add(step)
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_says_what_it_holds(module):
    doc = ast.get_docstring(ast.parse(MODULES[module].read_text()))
    assert doc and len(doc.split()) >= 4, f"{module} has no docstring saying what it holds"
