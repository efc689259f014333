"""Rows as Celery writes them, and a client of the dashboard over the test's store."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

from starlette.testclient import TestClient

from sqlease import Store

TOKEN = "t0ken-for-tests"


def celery_payload(
    name: str,
    args: list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    *,
    task_id: str = "x",
    parent_id: str | None = None,
    root_id: str | None = None,
    group: str | None = None,
) -> str:
    """A stored Kombu message of Celery's protocol 2 (headers, base64 JSON body)."""
    body = json.dumps([args or [], kwargs or {}, {"callbacks": None}]).encode()
    return json.dumps(
        {
            "body": base64.b64encode(body).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {
                "task": name,
                "id": task_id,
                "argsrepr": repr(tuple(args or [])),
                "kwargsrepr": repr(kwargs or {}),
                "parent_id": parent_id,
                "root_id": root_id or task_id,
                "group": group,
            },
            "properties": {"body_encoding": "base64", "delivery_tag": "x"},
        }
    )


def enqueue(store: Store, task_id: str, name: str = "shop.add", queue: str = "q", **kw: Any) -> int:
    args = kw.pop("args", [1, 2])
    family = {k: kw.pop(k) for k in ("parent_id", "root_id", "group") if k in kw}
    payload = celery_payload(name, args, task_id=task_id, **family)
    return store.enqueue(
        queue, payload, task_id=task_id, task_name=name, group_id=family.get("group"), **kw
    )


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "the page has no CSRF field"
    return found.group(1)


def login(client: TestClient, root: str = "") -> None:
    page = client.get(f"{root}/login")
    assert page.status_code == 200
    done = client.post(
        f"{root}/login",
        data={"csrf": csrf_of(page.text), "token": TOKEN, "next": f"{root}/"},
        follow_redirects=False,
    )
    assert done.status_code == 303, done.text


def act(client: TestClient, path: str, root: str = "", **fields: Any) -> Any:
    """Open a confirmation page, then submit its form with ``fields``."""
    page = client.get(f"{root}{path}")
    assert page.status_code == 200, page.text
    form = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', page.text))
    form.update(fields)
    target = re.search(r'<form method="post" action="([^"]+)"[^>]*id="confirm"', page.text)
    assert target, "no confirmation form"
    return client.post(target.group(1), data=form, follow_redirects=False)


def csrf_cookie(client: TestClient, root: str = "") -> str:
    """The CSRF value a browser holds after its first page."""
    client.get(f"{root}/")
    value = client.cookies.get("sqlease_ui_csrf")
    assert value
    return value
