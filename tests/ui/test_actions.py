"""Every action through the dashboard, on both databases, and the checks in front of them:
the token (bearer or login cookie), CSRF, read-only, the URL prefix."""

from __future__ import annotations

import re
import sys
import types
from typing import Any

import pytest
from starlette.testclient import TestClient

from sqlease import Admin, Store, WaitingForPerson
from sqlease.task_context import TaskContext
from sqlease.testing import FakeClock
from sqlease.ui import create_app

from .helpers import TOKEN, act, csrf_cookie, csrf_of, enqueue, login

LEASE = 10_000


def deliver(store: Store, queue: str = "q") -> TaskContext:
    [message] = store.claim([queue], "host-a:1:aa", lease_ms=LEASE)
    assert message.task_id is not None
    return TaskContext(
        store, message.fence, task_id=message.task_id, run_id=message.run_id, lease_ms=LEASE
    )


def wait_for_input(store: Store, task_id: str) -> None:
    enqueue(store, task_id)
    ctx = deliver(store)
    schema = {"type": "object", "required": ["size"], "properties": {"size": {"type": "integer"}}}
    with pytest.raises(WaitingForPerson):
        ctx.wait_for_input("Which size?", schema=schema)


def test_pause_resume_cancel_requeue(store: Store, admin: Admin, client: TestClient) -> None:
    enqueue(store, "t")
    deliver(store)
    login(client)
    done = act(client, "/task/do?id=t&action=pause")
    assert done.status_code == 303 and done.headers["location"] == "/task?id=t&done=pause"
    assert admin.task("t").state == "paused"
    assert act(client, "/task/do?id=t&action=resume").status_code == 303
    assert admin.task("t").state == "queued"
    assert act(client, "/task/do?id=t&action=cancel").status_code == 303
    assert admin.task("t").state == "cancelled"
    assert act(client, "/task/do?id=t&action=requeue").status_code == 303
    assert admin.task("t").state == "queued"
    # A refused transition shows the form again with the reason.
    again = act(client, "/task/do?id=t&action=resume")
    assert again.status_code == 409 and "it is not paused" in again.text
    assert 'id="confirm"' in again.text
    flash = client.get("/task?id=t&done=requeue").text
    assert "Done: requeue" in flash


def test_requeue_exhausted_tasks_one_and_many(
    store: Store, admin: Admin, client: TestClient, clock: FakeClock
) -> None:
    for task_id in ("p1", "p2", "p3"):
        enqueue(store, task_id, max_attempts=1)
    for _ in range(3):
        deliver(store)
    clock.advance(LEASE)
    assert store.claim(["q"], "w", lease_ms=LEASE) == []
    assert {t.task_id for t in admin.tasks(state="failed")} == {"p1", "p2", "p3"}
    login(client)
    page = client.get("/requeue?ids=p1&ids=p2")
    assert page.status_code == 200 and "Requeue 2 tasks?" in page.text
    done = client.post(
        "/requeue", data={"csrf": csrf_of(page.text), "ids": ["p1", "p2"]}, follow_redirects=False
    )
    assert done.status_code == 303 and "requeued+2" in done.headers["location"]
    assert {t.task_id for t in admin.tasks(state="failed")} == {"p3"}
    assert act(client, "/task/do?id=p3&action=requeue").status_code == 303
    assert admin.task("p3").state == "queued"
    assert client.get("/requeue").status_code == 400  # none chosen


def test_approve_and_reject_a_waiting_task(store: Store, admin: Admin, client: TestClient) -> None:
    for task_id in ("a", "b"):
        enqueue(store, task_id)
        ctx = deliver(store)
        with pytest.raises(WaitingForPerson):
            ctx.wait_for_approval(f"ship {task_id}?")
    login(client)
    # The waiting list's form opens the confirmation with the note typed there.
    prefilled = client.get("/task/do?id=a&action=approve&note=fine")
    assert 'name="note" value="fine"' in prefilled.text
    assert admin.task("a").state == "waiting_approval"  # nothing done by a GET
    assert act(client, "/task/do?id=a&action=approve", note="fine").status_code == 303
    empty = act(client, "/task/do?id=b&action=reject", reason="  ")
    assert empty.status_code == 400 and "needs a reason" in empty.text
    assert act(client, "/task/do?id=b&action=reject", reason="too dear").status_code == 303
    assert admin.task("a").state == "queued" and admin.task("b").state == "queued"
    answers = {}
    for _ in range(2):
        ctx = deliver(store)
        answers[ctx.task_id] = ctx.wait_for_approval(f"ship {ctx.task_id}?")
    assert answers == {
        "a": {"approved": True, "note": "fine"},
        "b": {"approved": False, "reason": "too dear"},
    }


def test_provide_input_shows_validation_errors_in_the_form(
    store: Store, admin: Admin, client: TestClient
) -> None:
    wait_for_input(store, "t")
    login(client)
    page = client.get("/task/do?id=t&action=input")
    assert "Which size?" in page.text and "<textarea" in page.text
    wrong = act(client, "/task/do?id=t&action=input", data='{"size": "big"}')
    assert wrong.status_code == 400 and "$.size must be integer" in wrong.text
    assert "{&#34;size&#34;: &#34;big&#34;}" in wrong.text  # what was typed is kept
    not_json = act(client, "/task/do?id=t&action=input", data="{size")
    assert not_json.status_code == 400 and "not JSON" in not_json.text
    assert admin.task("t").state == "waiting_input"
    assert act(client, "/task/do?id=t&action=input", data='{"size": 3}').status_code == 303
    again = deliver(store)
    assert again.wait_for_input("Which size?", schema=None) == {"size": 3}


def test_schedule_enable_disable_run(admin: Admin, client: TestClient) -> None:
    admin.add_schedule("nightly", "shop.add", every=3600, check_task=False)
    login(client)
    assert act(client, "/schedule/do?name=nightly&action=disable").status_code == 303
    assert admin.get_schedule("nightly")["enabled"] is False
    assert act(client, "/schedule/do?name=nightly&action=enable").status_code == 303
    assert admin.get_schedule("nightly")["enabled"] is True
    assert act(client, "/schedule/do?name=nightly&action=run").status_code == 303
    assert admin.get_schedule("nightly")["run_requested"] is True
    missing = act(client, "/schedule/do?name=nope&action=run")
    assert missing.status_code == 409 and "no periodic task entry" in missing.text


# ---- the checks ------------------------------------------------------------------------


def _post_pause(client: TestClient, csrf: str | None, **headers: str) -> Any:
    data = {"id": "t", "action": "pause"}
    if csrf is not None:
        data["csrf"] = csrf
    return client.post("/task/do", data=data, headers=headers, follow_redirects=False)


def test_actions_need_the_token(store: Store, admin: Admin, client: TestClient) -> None:
    enqueue(store, "t")
    csrf = csrf_cookie(client)
    refused = _post_pause(client, csrf)
    assert refused.status_code == 401 and "log in" in refused.text
    # The confirmation page sends a person to the login form first, and back.
    page = client.get("/task/do?id=t&action=pause", follow_redirects=False)
    assert page.status_code == 303 and page.headers["location"].startswith("/login?next=")
    wrong = client.post("/login", data={"csrf": csrf, "token": "guess", "next": "/"})
    assert wrong.status_code == 401 and "token is not the one" in wrong.text
    assert admin.task("t").state == "queued"
    # A bearer header is enough (with the CSRF pair, as every POST).
    ok = _post_pause(client, csrf, authorization=f"Bearer {TOKEN}")
    assert ok.status_code == 303 and admin.task("t").state == "paused"
    assert _post_pause(client, csrf, authorization="Bearer nope").status_code == 401


def test_every_post_needs_the_csrf_pair(store: Store, admin: Admin, client: TestClient) -> None:
    enqueue(store, "t")
    login(client)
    assert _post_pause(client, None).status_code == 403
    assert _post_pause(client, "x" * 43).status_code == 403
    csrf = csrf_cookie(client)
    cross = _post_pause(client, csrf, origin="https://evil.example")
    assert cross.status_code == 403
    # The login form too: without the pair nobody is logged in.
    fresh = TestClient(client.app)
    assert fresh.post("/login", data={"token": TOKEN}).status_code == 403
    assert admin.task("t").state == "queued"
    assert _post_pause(client, csrf, header_csrf="1").status_code == 303
    # An API client may send the value in a header instead of the form.
    admin.resume("t")
    by_header = client.post(
        "/task/do",
        data={"id": "t", "action": "pause"},
        headers={"x-csrf-token": csrf},
        follow_redirects=False,
    )
    assert by_header.status_code == 303


def test_read_only_and_tokenless_dashboards_refuse_actions(
    store: Store, admin: Admin, monkeypatch: pytest.MonkeyPatch
) -> None:
    enqueue(store, "t")
    monkeypatch.delenv("SQLEASE_UI_TOKEN", raising=False)
    for app, why in (
        (create_app(admin, token=TOKEN, read_only=True), "read-only"),
        (create_app(admin), "without a token"),
    ):
        with TestClient(app) as c:
            csrf = csrf_cookie(c)
            refused = _post_pause(c, csrf, authorization=f"Bearer {TOKEN}")
            assert refused.status_code == 403 and why in refused.text
            assert c.get("/task/do?id=t&action=pause").status_code == 403
            assert c.get("/login").status_code == 403
    assert admin.task("t").state == "queued"
    monkeypatch.setenv("SQLEASE_UI_TOKEN", "from-env")
    with TestClient(create_app(admin)) as c:
        csrf = csrf_cookie(c)
        assert _post_pause(c, csrf, authorization="Bearer from-env").status_code == 303


def test_logout_and_no_open_redirect(client: TestClient) -> None:
    login(client)
    page = client.get("/login?next=https://evil.example/")
    assert 'name="next" value="/"' in page.text
    csrf = csrf_of(page.text)
    done = client.post(
        "/login",
        data={"csrf": csrf, "token": TOKEN, "next": "//evil.example"},
        follow_redirects=False,
    )
    assert done.headers["location"] == "/"
    cookie = done.headers["set-cookie"]
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
    assert TOKEN not in cookie
    out = client.post("/logout", data={"csrf": csrf}, follow_redirects=False)
    assert out.status_code == 303
    assert "log in to act" in client.get("/").text


@pytest.mark.parametrize("strip", [True, False])
def test_under_a_url_prefix(store: Store, admin: Admin, strip: bool) -> None:
    """Behind a proxy at /ops/sqlease: every link, form, asset and redirect carries the
    prefix, whether the proxy strips it before passing the request on or not."""
    enqueue(store, "t")
    root = "/ops/sqlease"
    app = create_app(admin, token=TOKEN, root_path=root + "/")
    served: Any = app
    if strip:  # what nginx's proxy_pass http://host/; does

        async def served(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                assert scope["path"].startswith(root)
                scope = dict(scope, path=scope["path"][len(root) :] or "/")
            await app(scope, receive, send)

    sent = root
    with TestClient(served) as c:
        html = c.get(f"{sent}/").text
        for target in re.findall(r'(?:href|src|action)="([^"]+)"', html):
            assert target.startswith(root + "/"), target
        assert c.get(f"{sent}/static/app.css").status_code == 200
        assert "/ops/sqlease/fragments/overview" in html
        login(c, sent)
        assert c.cookies.get("sqlease_ui_session")
        done = act(c, f"{sent}/task/do?id=t&action=pause")
        assert done.headers["location"] == f"{root}/task?id=t&done=pause"
    assert admin.task("t").state == "paused"
    with pytest.raises(ValueError, match="root_path"):
        create_app(admin, root_path="ops")


def test_metrics_without_and_with_sqlease_metrics(
    admin: Admin, client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prometheus_client import CollectorRegistry, Gauge

    if "sqlease.metrics" not in sys.modules:
        try:
            import sqlease.metrics  # noqa: F401
        except ImportError:
            missing = client.get("/metrics")
            assert missing.status_code == 404 and "sqlease.metrics" in missing.text
    seen: list[Admin] = []

    def build_registry(given: Admin) -> CollectorRegistry:
        seen.append(given)
        registry = CollectorRegistry()
        Gauge("sqlease_test_value", "a test gauge", registry=registry).set(7)
        return registry

    fake = types.ModuleType("sqlease.metrics")
    fake.build_registry = build_registry  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sqlease.metrics", fake)
    page = client.get("/metrics")
    assert page.status_code == 200 and "sqlease_test_value 7.0" in page.text
    assert page.headers["content-type"].startswith("text/plain")
    assert seen == [admin]


def test_a_host_sign_in_in_the_scope_counts_only_for_an_app_built_for_a_host(
    store: Store, admin: Admin
) -> None:
    """The Django dashboard tells the app in the ASGI scope that Django signed the user in
    and checked CSRF; a standalone dashboard ignores that key, so nothing can borrow it."""
    from sqlease.ui._app import build
    from sqlease.ui._auth import HOST_KEY, HostAuth

    enqueue(store, "t")
    host = HostAuth(user="boss", csrf_field="csrfmiddlewaretoken", csrf="c" * 32)

    def claiming(app: Any) -> Any:
        async def wrapped(scope: Any, receive: Any, send: Any) -> None:
            await app(scope | {HOST_KEY: host}, receive, send)

        return wrapped

    options: dict[str, Any] = dict(read_only=False, root_path="", redact_args=False)
    standalone = build(admin, token=TOKEN, lease_seconds=60, **options)
    with TestClient(claiming(standalone)) as c:
        assert "log in to act" in c.get("/task?id=t").text
        refused = c.post("/task/do", data={"id": "t", "action": "pause"})
        assert refused.status_code == 403 and admin.task("t").state == "queued"
    hosted = build(admin, token=None, lease_seconds=60, host_auth=True, **options)
    with TestClient(hosted) as c:  # no host word: no CSRF check was made, nobody signed in
        assert c.post("/task/do", data={"id": "t", "action": "pause"}).status_code == 403
        assert c.get("/task/do?id=t&action=pause", follow_redirects=False).status_code == 303
        assert admin.task("t").state == "queued"
    with TestClient(claiming(hosted)) as c:
        page = c.get("/task/do?id=t&action=pause").text
        assert 'name="csrfmiddlewaretoken" value="' + "c" * 32 in page and "boss" in page
        done = c.post("/task/do", data={"id": "t", "action": "pause"}, follow_redirects=False)
        assert done.status_code == 303 and admin.task("t").state == "paused"
        assert c.get("/login").status_code == 404
