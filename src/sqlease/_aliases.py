"""The Kombu transport aliases sqlease registers (no heavy imports: ``import sqlease`` uses it).

``sqlease`` is the alias Kombu's ``Connection`` looks up for a ``sqlease+…`` URL: its
constructor splits the URL at the first ``+``. The full schemes are for failover: Kombu's
``Connection.switch()``, which moves to an alternate URL (``"url1;url2"``, ``alternates=``),
does not split the scheme, resolves the whole of it as the transport name, and hands the URL to
the transport in parts (``client.hostname``, ``port``, ``virtual_host`` …);
``sqlease.urls.client_url`` puts them back together. ``sqlease_autoload`` keeps a copy.
"""

from __future__ import annotations

TARGET = "sqlease.transport:Transport"

FULL_SCHEMES = (
    "sqlease+sqlite",
    "sqlease+postgresql",
    "sqlease+postgres",
    "sqlease+postgresql+psycopg",
)

ALIASES = ("sqlease", *FULL_SCHEMES)
