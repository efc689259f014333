"""Guard: imports run one way, adapters → facades → core → database layer → errors and types.

It walks every module's ``ast`` (module level, inside functions and under ``TYPE_CHECKING``
alike), so a lazy import cannot hide an edge. Rules:

- a module imports only from its own layer or a lower one;
- adapters do not import each other, apart from the edges listed in ``ADAPTER_EDGES``;
- the core and the database layer import neither kombu nor celery (``errors`` may: LeaseLost
  and WaitingForPerson are Celery ``Ignore`` signals);
- the import graph has no cycle, type-only and lazy imports included: a part names what it
  needs (a protocol, a callable), never the object that owns it;
- every module is assigned a layer, so a new one is placed on purpose;
- every name in ``LAYERS`` and ``ADAPTER_EDGES`` is an existing module, and every edge in
  ``ADAPTER_EDGES`` is used, so no entry outlives what it names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sqlease

ROOT = Path(sqlease.__file__).parent

#: Layers from the top, by top-level package or module (a module belongs to the entry naming
#: it or a package above it).
LAYERS: dict[str, tuple[str, ...]] = {
    "adapter": (
        # Kombu and Celery: the transport, the result backend, beat, a task's context, and
        # the glue they share in a process (durable defaults, task options, the store registry)
        "transport",
        "backend",
        "beat",
        "task_context",
        "_celery",
        # people and other programs: the command line, the dashboard, the metrics exporter
        "__main__",
        "cli",
        "ui",
        "metrics",
        # other frameworks: Django (sqlease.contrib.django), pytest (users' test suites)
        "contrib",
        "pytest_plugin",
    ),
    "facade": ("admin", "schedules", "store", "revokes", "transactions", "batches"),
    "core": ("_core", "options"),
    "db": ("_db",),
    "base": ("errors", "types", "delivery", "urls", "testing", "_aliases"),
}
RANK = {layer: rank for rank, layer in enumerate(reversed(LAYERS))}

#: Adapter → adapter edges that are part of the design (each one is used: a test checks it).
ADAPTER_EDGES = {
    # the task context finds the worker's transport (lazily, one way) for its store and lease
    ("task_context", "transport"),
    # the transport, the backend and beat share one store per database (_celery.registry); a
    # consuming worker writes its tasks' rate limits (_celery.task_limits); the backend and
    # beat find the app's sqlease broker URL (_celery.defaults)
    ("transport", "_celery"),
    ("backend", "_celery"),
    ("beat", "_celery"),
    # beat builds its fires ahead through the transport's channel and codec, so a prebuilt
    # message is the one the transport would have stored
    ("beat", "transport"),
    # ``python -m sqlease`` runs the command line
    ("__main__", "cli"),
    # ``sqlease ui`` and ``sqlease metrics`` start their servers (imported lazily: the extras)
    ("cli", "ui"),
    ("cli", "metrics"),
    # ``manage.py sqlease …`` runs the command line on the Django project's database
    ("contrib", "cli"),
    # the Django project serves the dashboard behind its own sign-in (contrib.django.dashboard)
    ("contrib", "ui"),
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
    """Every edge, type-only ones and lazy ones included."""
    every, _ = _graph()
    return every


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


def test_no_import_cycle_not_even_a_type_only_one() -> None:
    """The imports form a tree (a DAG): no module reaches itself by imports, lazy and
    ``TYPE_CHECKING`` ones included. A part names what it needs (a protocol, a callable),
    never the object that owns it."""
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
    assert "ui" in edges["cli._ops"]


def test_layers_and_edges_name_existing_modules() -> None:
    modules = _modules()
    named = [name for names in LAYERS.values() for name in names]
    assert len(named) == len(set(named)), "a name is in LAYERS twice"
    wrong = sorted(name for name in named if name not in modules)
    assert not wrong, f"LAYERS names modules that do not exist: {wrong}"
    adapters = set(LAYERS["adapter"])
    wrong = sorted(edge for edge in ADAPTER_EDGES if not set(edge) <= adapters)
    assert not wrong, f"ADAPTER_EDGES names what is no adapter of LAYERS, or no module: {wrong}"


def test_every_adapter_edge_is_used() -> None:
    edges, _ = _graph()
    used = {(_top(source), _top(target)) for source, targets in edges.items() for target in targets}
    stale = sorted(ADAPTER_EDGES - used)
    assert not stale, f"ADAPTER_EDGES lists edges no import makes: {stale}"
