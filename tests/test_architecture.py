"""The package's shape: stages that import only earlier stages, and no import cycle.

Every import statement counts, those inside functions and under TYPE_CHECKING included: a lazy
import is still a dependency. docs/architecture.md draws the same order.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "metrale_cli"
# The root's leaves: imported by any stage, importing no stage.
LEAVES = {"errors", "env", "compat", "bf16", "kernel_config", "arguments", "native"}
# Each stage may import the leaves, itself and the stages before it, never one after it.
STAGES = ["files", "model", "adapters", "layout", "engines", "pool", "image", "dist", "sim",
          "ops", "bench", "cli"]
# The library API resolves every name lazily, and `python -m metrale_cli` runs the CLI: both sit
# above the stages.
ENTRY_POINTS = {"metrale_cli", "metrale_cli.__main__"}
# Edges the reshape still removes: none are left. Each one listed must still exist, so that the
# list can only shrink.
PENDING: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def type_checking_blocks(tree: ast.Module) -> set[ast.AST]:
    """The imports under `if TYPE_CHECKING:`: dependencies for the stage order, never run."""
    blocks = [n for n in ast.walk(tree) if isinstance(n, ast.If)
              and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"]
    return {inner for block in blocks for stmt in block.body for inner in ast.walk(stmt)}


def imports_of(path: Path, modules: set[str], runtime: bool) -> set[str]:
    """The package's modules that `path` imports, wherever in the file the import stands
    (with `runtime`, leaving out those under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = type_checking_blocks(tree) if runtime else set()
    found = set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from a.b import c` is an import of the module a.b.c where there is one, else of a.b.
            submodules = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [name for name in submodules if name in modules] or [node.module]
        else:
            continue
        found.update(name for name in names if name in modules)
    found.discard(module_name(path))
    return found


def graph(runtime: bool = False) -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules, runtime) for p in paths}


def stage_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 2 and parts[1] in LEAVES:
        return -1
    assert len(parts) >= 2 and parts[1] in STAGES, (
        f"{module} is neither a leaf nor in a stage: add it to docs/architecture.md and here")
    return STAGES.index(parts[1])


def test_every_module_imports_only_leaves_and_earlier_stages() -> None:
    wrong, edges = [], graph()
    for module, imported in edges.items():
        if module in ENTRY_POINTS:
            continue
        for target in imported:
            # The root package only for its lazily resolved names (`__version__`).
            if target == "metrale_cli" or (module, target) in PENDING:
                continue
            if target in ENTRY_POINTS or stage_of(target) > stage_of(module):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))
    assert all(target in edges[module] for module, target in PENDING)


def test_no_import_cycle() -> None:
    edges = {module: {t for t in imported if t != "metrale_cli" and (module, t) not in PENDING}
             for module, imported in graph(runtime=True).items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module):] + [module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in sorted(edges[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(edges):
        visit(module, [])


def test_the_root_holds_only_leaves_and_entry_points() -> None:
    root = {p.stem for p in PACKAGE.glob("*.py")}
    assert root - LEAVES == {"__init__", "__main__"}
    assert {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()} <= set(STAGES)
