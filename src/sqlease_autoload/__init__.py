"""Makes ``sqlease+…`` broker URLs work even where the app module never imports sqlease.

A separate top-level package on purpose: Kombu imports it while Celery is still half imported,
so it must not import ``sqlease`` itself (whose errors subclass Celery's) at that moment.

Kombu resolves a transport only through ``kombu.transport.TRANSPORT_ALIASES`` and has no entry
point group for transports. It does load the ``kombu.serializers`` entry points when
``kombu.serialization`` is imported, which every Celery app does. sqlease ships one such entry
point whose import registers the transport alias and the durable defaults; the serializer it
registers (``sqlease_autoload``, JSON under its own content type) is harmless and unused.
This is a documented workaround: ``import sqlease`` in the app module, or
``broker_transport = "sqlease.transport:Transport"``, are the supported ways.

Kombu imports its serializers while Celery itself is still half imported, so the durable
defaults (which need ``celery._state``) are registered right after ``celery.app.base`` has
finished loading, through a one-shot import hook.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
from types import ModuleType
from typing import Any

from kombu.transport import TRANSPORT_ALIASES

TRANSPORT_ALIASES.setdefault("sqlease", "sqlease.transport:Transport")
# The full schemes, for Kombu's failover to an alternate URL (a copy of sqlease._aliases).
for _scheme in (
    "sqlease+sqlite",
    "sqlease+postgresql",
    "sqlease+postgres",
    "sqlease+postgresql+psycopg",
):
    TRANSPORT_ALIASES.setdefault(_scheme, "sqlease.transport:Transport")

_WATCHED = "celery.app.base"


def _register_defaults() -> None:
    try:
        importlib.import_module("sqlease._celery.defaults")
    except ImportError:  # pragma: no cover - kombu without celery
        pass


class _AfterCeleryLoads(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs the real loader of ``celery.app.base``, then registers the durable defaults."""

    def __init__(self) -> None:
        self._spec: importlib.machinery.ModuleSpec | None = None

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _WATCHED:
            return None
        sys.meta_path.remove(self)  # one shot
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        self._spec = spec
        return importlib.util.spec_from_loader(name, self, origin=spec.origin, is_package=False)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        assert self._spec is not None and self._spec.loader is not None
        return self._spec.loader.create_module(self._spec)

    def exec_module(self, module: ModuleType) -> None:
        assert self._spec is not None and self._spec.loader is not None
        module.__spec__ = self._spec
        module.__file__ = self._spec.origin
        self._spec.loader.exec_module(module)
        _register_defaults()


if _WATCHED in sys.modules:
    _register_defaults()
elif "sqlease._celery.defaults" not in sys.modules:
    sys.meta_path.insert(0, _AfterCeleryLoads())


def _dumps(obj: Any) -> str:
    return json.dumps(obj)


serializer = (_dumps, json.loads, "application/x-sqlease-autoload", "utf-8")
