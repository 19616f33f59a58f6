"""The package's layout holds: floors that import only downwards, no import circle, small modules.

docs/architecture.md draws the floors; this test is what keeps the tree honest when code moves.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "monarch_sky"
# Bottom to top: a module imports from its own floor or a lower one, never from above.
FLOORS = [
    ["common"],  # every side: accelerator shims, Monarch settings, checkpoint layout, test switches
    ["recipes"],  # the TorchTitan models and job defaults
    ["hosts"],  # providers, and what runs on a node before any trainer
    ["replica"],  # inside a trainer process
    ["faults"],  # the fault spec and the controller's injector
    ["config", "validation", "config_help", "titan_keys", "model_shapes"],  # the job's settings
    ["record"],  # display, run record, outcome
    ["control"],  # the controller
    ["bench"],  # benchmarks, which run the product and its peers
    ["standby", "run", "cli", "cli_fetch", "__main__"],  # entry points
]
FLOOR_OF = {unit: i for i, units in enumerate(FLOORS) for unit in units}
MAX_LINES = 300


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every monarch_sky module `name` imports at run time, lazily or not (not for type checks)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                   for stmt in block.body for n in ast.walk(stmt)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("monarch_sky")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            if base.startswith("monarch_sky"):
                out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return out - {name, "monarch_sky"}


def unit(module: str) -> str:
    return module.split(".")[1]


def test_every_module_sits_on_a_floor():
    assert not {unit(m) for m in modules() if m != "monarch_sky"} - set(FLOOR_OF), (
        "a new top-level module or package: give it a floor in FLOORS and in docs/architecture.md")


def test_imports_only_go_down_the_floors():
    known = modules()
    upward = [f"{m} imports {i}" for m, path in known.items() if m != "monarch_sky"
              for i in imports(m, path, known) if FLOOR_OF[unit(i)] > FLOOR_OF[unit(m)]]
    assert not upward, upward


def test_no_import_circle():
    known = modules()
    graph = {m: imports(m, path, known) & set(known) for m, path in known.items()}
    done, on_path = set(), []

    def visit(m):
        if m in on_path:
            raise AssertionError("import circle: " + " -> ".join(on_path[on_path.index(m):] + [m]))
        if m in done:
            return
        on_path.append(m)
        for dep in sorted(graph[m]):
            visit(dep)
        on_path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_modules_stay_small():
    big = {str(p.relative_to(REPO)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"over {MAX_LINES} lines, split by responsibility: {big}"
