"""Guard: imports run one way, adapters → facades → core → database layer → errors and types.

It walks every module's ``ast`` (module level, inside functions and under ``TYPE_CHECKING``
alike), so a lazy import cannot hide an edge. Rules:

- a module imports only from its own layer or a lower one;
- adapters do not import each other, apart from the edges listed in ``ADAPTER_EDGES``;
- the core and the database layer import neither kombu nor celery (``errors`` may: LeaseLost
  and WaitingForPerson are Celery ``Ignore`` signals);
- the import graph has no cycle (a type-only import inside one package, such as a part's
  annotation naming the ``Transport`` that owns it, is not an edge for this rule: it never
  runs, and the owner and its parts are one unit);
- every module is assigned a layer, so a new one is placed on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sqlease

ROOT = Path(sqlease.__file__).parent

#: Layers from the top. A module belongs to the first entry naming it or a package above it.
LAYERS: dict[str, tuple[str, ...]] = {
    "adapter": (
        "transport",
        "backend",
        "task_context",
        "cli",
        "__main__",
        "_celery",
        "loop_calls",
        "background",
        "beat",
        "metrics",
        "ui",
    ),
    "facade": (
        "store",
        "admin",
        "revokes",
        "transactions",
        "schedules",
    ),
    "core": ("_core", "options"),
    "db": ("_db",),
    "base": ("errors", "types", "delivery", "_aliases", "urls", "testing"),
}
RANK = {layer: rank for rank, layer in enumerate(reversed(LAYERS))}

#: Adapter → adapter edges that are part of the design.
ADAPTER_EDGES = {
    # the task context finds the worker's transport (lazily, one way) for its store and lease
    ("task_context", "transport"),
    # the transport's runners and the Celery defaults it relies on
    ("transport", "loop_calls"),
    ("transport", "background"),
    ("loop_calls", "background"),
    ("backend", "_celery"),
    # the command line: ``python -m sqlease``, and the servers ``sqlease ui`` and ``sqlease
    # metrics`` start (imported lazily: the ui and metrics extras)
    ("__main__", "cli"),
    ("cli", "metrics"),
    ("cli", "ui"),
    # the beat finds the app's sqlease broker URL as the backend does
    ("beat", "_celery"),
    # a consuming worker writes its tasks' rate limits (cluster_rate_limits)
    ("transport", "_celery"),
}
FOREIGN = ("kombu", "celery", "billiard", "vine")


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            found[".".join(parts)] = path
    return found


def _layer(module: str) -> str:
    for layer, names in LAYERS.items():
        for name in names:
            if module == name or module.startswith(name + "."):
                return layer
    raise AssertionError(f"sqlease.{module} is in no layer: add it to LAYERS")


def _top(module: str) -> str:
    for names in LAYERS.values():
        for name in names:
            if module == name or module.startswith(name + "."):
                return name
    return module


def _type_only(tree: ast.Module) -> set[int]:
    """The ids of the import nodes under ``if TYPE_CHECKING:``."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            found.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return found


def _imports(
    module: str, path: Path, known: set[str], *, runtime_only: bool = False
) -> tuple[set[str], set[str]]:
    """(sqlease modules imported, foreign top-level packages imported)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    inner: set[str] = set()
    foreign: set[str] = set()
    tree = ast.parse(path.read_text())
    skip = _type_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("sqlease."):
                    inner.add(alias.name.removeprefix("sqlease."))
                elif alias.name.split(".")[0] in FOREIGN:
                    foreign.add(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            elif node.module and node.module.startswith("sqlease"):
                target = node.module.removeprefix("sqlease").lstrip(".")
            else:
                if node.module and node.module.split(".")[0] in FOREIGN:
                    foreign.add(node.module.split(".")[0])
                continue
            for alias in node.names:  # `from . import x` names a module
                candidate = f"{target}.{alias.name}" if target else alias.name
                inner.add(candidate if candidate in known else target)
    inner.discard("")
    return {m for m in inner if m in known and m != module}, foreign


def _graph(*, runtime_only: bool = False) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = _modules()
    known = set(modules)
    edges, foreign = {}, {}
    for name, path in modules.items():
        edges[name], foreign[name] = _imports(name, path, known, runtime_only=runtime_only)
    return edges, foreign


def _cycle_edges() -> dict[str, set[str]]:
    """Every edge, less the type-only ones between modules of one package."""
    every, _ = _graph()
    runtime, _ = _graph(runtime_only=True)
    return {
        source: {t for t in targets if t in runtime[source] or _top(t) != _top(source)}
        for source, targets in every.items()
    }


def test_every_module_has_a_layer() -> None:
    for module in _modules():
        _layer(module)


def test_imports_point_down() -> None:
    edges, _ = _graph()
    wrong = []
    for source, targets in edges.items():
        for target in targets:
            if RANK[_layer(target)] > RANK[_layer(source)]:
                wrong.append(f"{source} ({_layer(source)}) imports {target} ({_layer(target)})")
    assert not wrong, "\n".join(sorted(wrong))


def test_adapters_do_not_import_each_other() -> None:
    edges, _ = _graph()
    wrong = []
    for source, targets in edges.items():
        for target in targets:
            a, b = _top(source), _top(target)
            if (
                a != b
                and _layer(source) == _layer(target) == "adapter"
                and (a, b) not in ADAPTER_EDGES
            ):
                wrong.append(f"{source} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_core_and_database_layer_are_free_of_kombu_and_celery() -> None:
    _, foreign = _graph()
    wrong = {m: sorted(f) for m, f in foreign.items() if f and _layer(m) in ("core", "db", "base")}
    wrong.pop("errors", None)
    assert not wrong


def test_no_import_cycle() -> None:
    edges = _cycle_edges()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycle = [*path[path.index(node) :], node]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if node in done:
            return
        for target in sorted(edges[node]):
            visit(target, [*path, node])
        done.add(node)

    for module in sorted(edges):
        visit(module, [])


def test_the_walk_sees_lazy_and_typing_imports() -> None:
    # The guard is only as good as its walk: these edges are inside functions or under
    # TYPE_CHECKING today.
    edges, _ = _graph()
    assert "transport" in edges["task_context"]
    assert "store" in edges["transactions"]
