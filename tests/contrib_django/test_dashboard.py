"""The dashboard served by a Django project (``include("sqlease.contrib.django.urls")``), on
both database aliases, through Django's test client: a visitor is sent to Django's sign-in, a
user who is not staff gets 403, staff see the tasks, and every action is a POST that passes
Django's CSRF check and changes the task through ``Admin``, writing the timeline event the
command line writes."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from sqlease import Admin, ConfigurationError, Store
from sqlease.cli import main
from sqlease.contrib.django.conf import url_of_alias

ROOT = "/ops/sqlease"


@pytest.fixture
def store(alias: str, prefix: str) -> Iterator[Store]:
    """sqlease's tables on the alias (``SQLEASE_DATABASE``), under the test's prefix."""
    from django.test import override_settings

    with override_settings(SQLEASE_DATABASE=alias):
        made = Store(url_of_alias(alias), table_prefix=prefix)
        yield made
        made.engine.dispose()


@pytest.fixture
def db_url_of_store(store: Store) -> str:
    return store.engine.url.render_as_string(hide_password=False)


@pytest.fixture
def admin(store: Store) -> Admin:
    return Admin(store.engine.url, store=store)


def _user(staff: bool) -> Any:
    from django.contrib.auth.models import User
    from django.core.management import call_command

    call_command("migrate", "auth", database="default", verbosity=0)
    return User.objects.create_user(
        f"u-{uuid.uuid4().hex[:8]}", password="pw-for-tests", is_staff=staff
    )


def _client(user: Any = None) -> Any:
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    if user is not None:
        client.force_login(user)
    return client


def _rows(html: str) -> list[str]:
    return re.findall(r'<tr data-task="([^"]+)">', html)


def _confirm_form(client: Any, task_id: str, action: str) -> tuple[str, dict[str, str]]:
    """The confirmation page of an action: its form's target and fields."""
    page = client.get(f"{ROOT}/task/do", {"id": task_id, "action": action})
    assert page.status_code == 200, page.content
    html = page.content.decode()
    target = re.search(r'<form method="post" action="([^"]+)"[^>]*id="confirm"', html)
    assert target, "no confirmation form"
    fields = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', html))
    return target.group(1), fields


def test_a_visitor_is_sent_to_sign_in_and_non_staff_get_403(store: Store) -> None:
    store.enqueue("celery", "{}", task_id="t1", task_name="shop.ship")
    anonymous = _client()
    for path in ("/", "/tasks?state=queued", "/task?id=t1", "/static/app.css"):
        page = anonymous.get(ROOT + path)
        assert page.status_code == 302, path
        assert page["Location"].startswith(f"/accounts/login/?next={ROOT}/"), path
    assert anonymous.post(f"{ROOT}/task/do", {"id": "t1", "action": "cancel"}).status_code in (
        302,
        403,  # Django's CSRF check answers first: no token
    )
    clerk = _client(_user(staff=False))
    assert clerk.get(f"{ROOT}/tasks").status_code == 403
    assert clerk.get(f"{ROOT}/").status_code == 403
    refused = clerk.post(f"{ROOT}/task/do", {"id": "t1", "action": "cancel"})
    assert refused.status_code == 403
    assert Admin(store.engine.url, store=store).task("t1").state == "queued"


def test_staff_see_every_task_and_its_timeline(store: Store, admin: Admin) -> None:
    store.enqueue("celery", "{}", task_id="done", task_name="shop.done")
    [message] = store.claim(["celery"], "host-a:1:aa", lease_ms=60_000)
    store.ack([message.fence])
    store.enqueue("celery", "{}", task_id="waits", task_name="shop.waits")
    staff = _client(_user(staff=True))
    overview = staff.get(f"{ROOT}/")
    assert overview.status_code == 200
    html = overview.content.decode()
    assert f'href="{ROOT}/tasks"' in html and "log in to act" not in html
    listed = staff.get(f"{ROOT}/tasks").content.decode()
    assert _rows(listed) == ["waits", "done"]
    assert 'class="state succeeded"' in listed and "shop.waits" in listed
    assert _rows(staff.get(f"{ROOT}/tasks", {"state": "queued"}).content.decode()) == ["waits"]
    task = staff.get(f"{ROOT}/task", {"id": "done"}).content.decode()
    assert "claimed" in task and "acked" in task
    assert staff.get(f"{ROOT}/static/app.css").status_code == 200
    assert staff.get(f"{ROOT}/fragments/tasks").status_code == 200
    # signing in and out is Django's, not the dashboard's token form
    assert staff.get(f"{ROOT}/login").status_code == 404


def test_actions_are_csrf_checked_posts_through_admin(
    store: Store, admin: Admin, db_url_of_store: str, prefix: str
) -> None:
    for task_id in ("web", "cli"):
        store.enqueue("celery", "{}", task_id=task_id, task_name="shop.ship")
    staff = _client(_user(staff=True))
    target, fields = _confirm_form(staff, "web", "pause")
    assert target == f"{ROOT}/task/do" and fields["action"] == "pause"
    assert fields.get("csrfmiddlewaretoken"), "the form carries Django's CSRF token"
    # without the token Django refuses the POST and nothing changes
    without = {k: v for k, v in fields.items() if k != "csrfmiddlewaretoken"}
    assert staff.post(target, without).status_code == 403
    assert admin.task("web").state == "queued"
    done = staff.post(target, fields)
    assert done.status_code == 303 and done["Location"] == f"{ROOT}/task?id=web&done=pause"
    assert admin.task("web").state == "paused"
    # the same event as the command line's pause
    base = ["--url", db_url_of_store, "--table-prefix", prefix]
    assert main([*base, "pause", "cli"]) == 0

    def last(task_id: str) -> tuple[str, Any]:
        event = admin.task(task_id).events[-1]
        return event["kind"], event.get("data")

    assert last("web") == last("cli") == ("paused", last("cli")[1])
    for action, state in (("resume", "queued"), ("cancel", "cancelled")):
        target, fields = _confirm_form(staff, "web", action)
        assert staff.post(target, fields).status_code == 303
        assert main([*base, action, "cli"]) == 0
        assert admin.task("web").state == admin.task("cli").state == state
        assert last("web") == last("cli")
    # a refused transition says why, and changes nothing
    target, fields = _confirm_form(staff, "web", "pause")
    refused = staff.post(target, fields)
    assert (
        refused.status_code == 409
        and "not queued, scheduled or running" in refused.content.decode()
    )
    assert admin.task("web").state == "cancelled"
    # requeue from the failed list (a batch form)
    target, fields = _confirm_form(staff, "web", "requeue")
    assert staff.post(target, fields).status_code == 303
    assert admin.task("web").state == "queued"
    assert [e["kind"] for e in admin.task("web").events][-1] == "requeued"


def test_read_only_and_bad_settings(store: Store, admin: Admin) -> None:
    from django.test import override_settings

    store.enqueue("celery", "{}", task_id="t", task_name="shop.ship")
    staff = _client(_user(staff=True))
    with override_settings(SQLEASE_DASHBOARD_READ_ONLY=True):
        html = staff.get(f"{ROOT}/task", {"id": "t"}).content.decode()
        assert "read-only" in html and "/task/do?" not in html
        assert staff.get(f"{ROOT}/task/do", {"id": "t", "action": "cancel"}).status_code == 403
    assert admin.task("t").state == "queued"
    bad = {"SQLEASE_DASHBOARD_READ_ONLY": "yes", "SQLEASE_DASHBOARD_LEASE_SECONDS": 0}
    for name, value in bad.items():
        with override_settings(**{name: value}), pytest.raises(ConfigurationError, match=name):
            staff.get(f"{ROOT}/")


def test_under_django_asgi(store: Store, admin: Admin) -> None:
    """Served by Django's ASGI handler (the view runs in Django's sync thread and forwards
    to the dashboard's own event loop): pages and a CSRF-checked action."""
    import asyncio

    from django.test import AsyncClient

    store.enqueue("celery", "{}", task_id="a1", task_name="shop.ship")
    user = _user(staff=True)

    async def visit() -> tuple[Any, Any]:
        client = AsyncClient(enforce_csrf_checks=True)
        await client.aforce_login(user)
        listed = await client.get(f"{ROOT}/tasks")
        confirm = await client.get(f"{ROOT}/task/do", {"id": "a1", "action": "cancel"})
        html = confirm.content.decode()
        fields = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', html))
        done = await client.post(f"{ROOT}/task/do", fields)
        return listed, done

    listed, done = asyncio.run(visit())
    assert listed.status_code == 200 and _rows(listed.content.decode()) == ["a1"]
    assert done.status_code == 303
    assert admin.task("a1").state == "cancelled"
    assert admin.task("a1").events[-1]["kind"] == "cancelled"
