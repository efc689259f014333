"""Guards: the database is reached only through the driver, and a facade's parts only
through their public methods.

- No module outside ``sqlease._db`` opens a connection or transaction of its own
  (``engine.begin()``, ``engine.connect()``, ``raw_connection()``): every read goes through
  ``driver.reading()``, every write through ``driver.writing()`` or a driver operation, which
  on SQLite puts it inside the fork guard.
- No module reaches into a store's or an admin's private attributes (``store._x``,
  ``admin._x``): what a caller needs is an aggregate's or the driver's public method.
"""

from __future__ import annotations

import re
from pathlib import Path

import sqlease

ROOT = Path(sqlease.__file__).parent

OWN_CONNECTION = re.compile(r"\.(begin|connect|raw_connection)\(\)")
ENGINE_USE = re.compile(r"\bengine\.(begin|connect|raw_connection)\(")
#: ``store._x`` or ``self.store._x`` (not a module path such as ``sqlease.admin._stats``).
PRIVATE_REACH = re.compile(r"(?<![\w.])(?:self\.)?(?:store|admin)\._[a-z]\w*")


def _sources() -> list[tuple[str, str]]:
    return [
        (path.relative_to(ROOT).as_posix(), path.read_text()) for path in sorted(ROOT.rglob("*.py"))
    ]


def test_no_module_outside_the_database_layer_opens_a_connection() -> None:
    found = [
        f"{name}: {match.group(0)}"
        for name, text in _sources()
        if not name.startswith("_db/")
        for match in ENGINE_USE.finditer(text)
    ]
    assert not found, "\n".join(found)


def test_no_module_reaches_into_a_facade_s_private_parts() -> None:
    found = [
        f"{name}: {match.group(0)}"
        for name, text in _sources()
        for match in PRIVATE_REACH.finditer(text)
    ]
    assert not found, "\n".join(found)


def test_the_guards_find_what_they_look_for() -> None:
    sample = "with self.store.engine.begin() as conn: store._reading(); admin._now()"
    assert ENGINE_USE.search(sample)
    reached = [m.group(0) for m in PRIVATE_REACH.finditer(sample)]
    assert reached == ["store._reading", "admin._now"]
    assert not PRIVATE_REACH.search("from sqlease.admin._stats import StatsAdmin")


CLASS = re.compile(r"^class (\w+)", re.MULTILINE)


def test_no_two_classes_share_a_name_and_none_is_named_for_its_speed() -> None:
    """A name says what a thing is for (a ``DirectLane``, not a ``FastPath``), and says it
    once: a reader who meets it knows which one it is."""
    seen: dict[str, list[str]] = {}
    for name, text in _sources():
        for found in CLASS.findall(text):
            seen.setdefault(found, []).append(name)
    shared = {cls: where for cls, where in seen.items() if len(where) > 1}
    assert not shared, shared
    speedy = [cls for cls in seen if "fast" in cls.lower() or "slow" in cls.lower()]
    assert not speedy, speedy
    modules = [p.name for p in ROOT.rglob("*.py") if "fast" in p.stem]
    assert not modules, modules
