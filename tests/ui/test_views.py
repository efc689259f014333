"""Every page against a real database (SQLite and PostgreSQL): what it shows is what the
store holds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from sqlease import Admin, SchemaMissing, Store, WaitingForPerson
from sqlease._core.results import ResultStore
from sqlease.task_context import TaskContext
from sqlease.testing import FakeClock
from sqlease.ui import create_app
from sqlease.ui._read.views import AdminViews

from .helpers import TOKEN, enqueue

LEASE = 10_000


def deliver(store: Store, owner: str = "host-a:1:aa", queue: str = "q") -> TaskContext:
    [message] = store.claim([queue], owner, lease_ms=LEASE)
    assert message.task_id is not None
    return TaskContext(
        store, message.fence, task_id=message.task_id, run_id=message.run_id, lease_ms=LEASE
    )


def cell(html: str, row_attr: str, column: int) -> str:
    """The text of one cell of the row marked ``row_attr`` (tags stripped)."""
    row = re.search(rf"<tr {row_attr}>(.*?)</tr>", html, flags=re.S)
    assert row, f"no row {row_attr}"
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row.group(1), flags=re.S)
    return re.sub(r"<[^>]+>", "", cells[column]).strip()


def test_overview_counts_workers_and_throughput(
    store: Store, client: TestClient, clock: FakeClock
) -> None:
    for i in range(3):
        enqueue(store, f"r{i}", queue="mail")
    enqueue(store, "later", queue="mail", delay_ms=60_000)
    enqueue(store, "dead", queue="mail", max_attempts=1)
    enqueue(store, "held", queue="img")
    [dead_msg] = store.claim(["mail"], "w", lease_ms=LEASE)  # r0: id order within priority
    store.ack([dead_msg.fence])
    running = deliver(store, "host-b:7:bb", queue="img")
    clock.advance(1_500)
    page = client.get("/")
    assert page.status_code == 200
    html = page.text
    # ready, scheduled, running, waiting, paused, failed, cancelled, oldest ready
    assert cell(html, 'data-queue="mail"', 1) == "3"
    assert cell(html, 'data-queue="mail"', 2) == "1"
    assert cell(html, 'data-queue="img"', 3) == "1"
    assert cell(html, 'data-queue="mail"', 8) == "1.5 s"
    assert "host-b:7:bb" in html and ">host-b<" in html
    # one finished delivery in the newest bucket of the chart
    assert re.search(r"<title>[^<]*: 1 finished, 0 failed</title>", html)
    fragment = client.get("/fragments/overview")
    assert fragment.status_code == 200 and "<html" not in fragment.text
    assert "host-b:7:bb" in fragment.text
    store.ack([running.fence])
    # Pages asking within 2 s share one read (every open tab polls the overview) ...
    assert "host-b:7:bb" in client.get("/fragments/overview").text
    clock.advance(2_000)
    assert "host-b:7:bb" not in client.get("/fragments/overview").text


def test_throughput_counts_failed_and_finished_per_bucket(
    store: Store, admin: Admin, clock: FakeClock
) -> None:
    enqueue(store, "a")
    enqueue(store, "b", max_attempts=1)
    ctx = deliver(store)
    store.ack([ctx.fence])
    clock.advance(120_000)
    deliver(store)  # b: attempt 1 of 1
    clock.advance(LEASE)
    assert store.claim(["q"], "w", lease_ms=LEASE) == []  # b is exhausted
    series = AdminViews(admin).throughput(minutes=10, bucket_s=60)
    assert sum(d for _, d, _ in series.buckets) == 1
    assert sum(f for _, _, f in series.buckets) == 1
    done_at = [b for b, d, _ in series.buckets if d]
    failed_at = [b for b, _, f in series.buckets if f]
    assert failed_at[0] - done_at[0] >= 120_000


def test_tasks_filters_and_keyset_pages(
    store: Store, admin: Admin, client: TestClient, clock: FakeClock
) -> None:
    for i in range(7):
        enqueue(store, f"t{i}", name="shop.add" if i % 2 else "shop.mail", queue="q")
    clock.advance(10_000)
    enqueue(store, "other", name="shop.add", queue="other", run_id="R1")
    views = AdminViews(admin)
    first = views.task_page(limit=3)
    assert [r.task_id for r in first.rows] == ["other", "t6", "t5"]
    second = views.task_page(limit=3, before=first.next_before)
    assert [r.task_id for r in second.rows] == ["t4", "t3", "t2"]
    last = views.task_page(limit=3, before=second.next_before)
    assert [r.task_id for r in last.rows] == ["t1", "t0"] and last.next_before is None
    assert {r.task_id for r in views.task_page(name="shop.mail").rows} == {"t0", "t2", "t4", "t6"}
    assert [r.task_id for r in views.task_page(queue="other").rows] == ["other"]
    assert [r.task_id for r in views.task_page(run_id="R1").rows] == ["other"]
    assert [r.task_id for r in views.task_page(search="t3").rows] == ["t3"]
    assert [r.task_id for r in views.task_page(since_ms=clock() - 1).rows] == ["other"]
    assert len(views.task_page(until_ms=clock() - 1).rows) == 7
    deliver(store)  # t0 runs
    assert [r.task_id for r in views.task_page(state="running").rows] == ["t0"]
    assert len(views.task_page(state="queued").rows) == 7
    # The page: filters in the form, a link to the next page.
    html = client.get("/tasks?name=shop.mail").text
    assert html.count('data-task="') == 4 and "shop.mail" in html
    assert client.get("/tasks?state=running").text.count('data-task="') == 1
    assert client.get("/tasks?queue=other").text.count('data-task="') == 1
    assert "Older tasks" not in html
    page = client.get("/tasks?state=bogus")
    assert page.status_code == 400 and "unknown state" in page.text
    assert client.get("/tasks?since=yesterday").status_code == 400
    fragment = client.get("/fragments/tasks?q=t3")
    assert fragment.text.count('data-task="') == 1


def test_tasks_page_links_to_the_next_page(store: Store, client: TestClient) -> None:
    for i in range(55):
        enqueue(store, f"t{i:02}")
    html = client.get("/tasks").text
    assert html.count('data-task="') == 50
    link = re.search(r'href="(/tasks\?[^"]*before=\d+%3At\d+)"', html)
    assert link, "the list of every task pages by a record cursor"
    rest = client.get(link.group(1).replace("&amp;", "&")).text
    assert rest.count('data-task="') == 5 and "Older tasks" not in rest
    # a state's list pages by message id
    html = client.get("/tasks?state=queued").text
    link = re.search(r'href="(/tasks\?[^"]*before=\d+)"', html)
    assert link
    rest = client.get(link.group(1).replace("&amp;", "&")).text
    assert rest.count('data-task="') == 5
    assert client.get("/tasks?before=12").status_code == 400
    assert client.get("/tasks?state=queued&before=1%3At").status_code == 400


def test_with_no_filter_every_recent_task_is_listed_newest_first(
    store: Store, admin: Admin, client: TestClient, clock: FakeClock
) -> None:
    """Finished tasks have no message: the unfiltered list comes from the task records, so
    succeeded, failed, cancelled, parked, running and queued tasks are all on it."""
    results = ResultStore(store)
    for task_id in ("ok", "boom", "gone", "held", "busy", "new"):
        enqueue(store, task_id, name=f"shop.{task_id}")
        clock.advance(1000)
    for task_id, status in (("ok", "SUCCESS"), ("boom", "FAILURE")):
        ctx = deliver(store)
        assert ctx.task_id == task_id
        meta = json.dumps({"status": status, "result": 1, "task_id": task_id}).encode()
        results.put(f"celery-task-meta-{task_id}", meta, state=status, task_id=task_id)
        store.ack([ctx.fence])
    admin.cancel("gone")
    admin.pause("held")
    busy = deliver(store)
    assert busy.task_id == "busy"
    views = AdminViews(admin)
    expected = [
        ("new", "queued"),
        ("busy", "running"),
        ("held", "paused"),
        ("gone", "cancelled"),
        ("boom", "failed"),
        ("ok", "succeeded"),
    ]
    page = views.task_page()
    assert [(r.task_id, r.state) for r in page.rows] == expected
    assert page.rows[1].lease_owner == "host-a:1:aa" and page.rows[5].name == "shop.ok"
    # keyset pages by the record cursor, the same rows in the same order
    walked, before = [], None
    while True:
        part = views.task_page(limit=4, before=before)
        walked += [(r.task_id, r.state) for r in part.rows]
        if part.next_before is None:
            break
        before = part.next_before
    assert walked == expected
    # the filters the task record answers
    assert [r.task_id for r in views.task_page(name="shop.ok").rows] == ["ok"]
    assert [r.task_id for r in views.task_page(search="boom").rows] == ["boom"]
    # and a state filter still lists that state only
    assert [r.task_id for r in views.task_page(state="paused").rows] == ["held"]
    assert [r.task_id for r in views.task_page(state="succeeded").rows] == ["ok"]
    html = client.get("/tasks").text
    assert [re.findall(r'<tr data-task="([^"]+)">', html)] == [[t for t, _ in expected]]
    assert 'class="state succeeded"' in html and 'class="state running"' in html
    listed = client.get("/tasks?state=cancelled").text
    assert re.findall(r'<tr data-task="([^"]+)">', listed) == ["gone"]


def test_search_finds_a_finished_task(store: Store, client: TestClient) -> None:
    enqueue(store, "gone")
    ctx = deliver(store)
    store.ack([ctx.fence])
    html = client.get("/tasks?q=gone").text  # on the list of every task, from its record
    assert re.findall(r'<tr data-task="([^"]+)">', html) == ["gone"]
    assert 'class="state succeeded"' in html
    html = client.get("/tasks?state=queued&q=gone").text  # not queued: found elsewhere
    assert "has finished (succeeded)" in html and "/task?id=gone" in html


def test_task_page_timeline_leases_checkpoints_steps_and_result(
    store: Store, client: TestClient, clock: FakeClock
) -> None:
    enqueue(store, "t", args=[5, "secret-arg"], parent_id="p", root_id="root-1", group="g1")
    first = deliver(store, "host-a:1:aa")
    first.checkpoint({"page": 1, "cursor": "x"})
    first.step("charge", lambda: {"ok": True})
    clock.advance(LEASE)  # host-a dies: its lease expires
    second = deliver(store, "host-b:2:bb")
    second.checkpoint({"page": 2, "cursor": None})
    results = ResultStore(store)
    meta = {
        "status": "FAILURE",
        "result": {"exc_type": "ValueError", "exc_message": ["boom"]},
        "traceback": "Traceback (most recent call last):\n  ValueError: boom",
        "task_id": "t",
        "children": [],
    }
    results.put("celery-task-meta-t", json.dumps(meta).encode(), state="FAILURE", task_id="t")
    results.put(
        "celery-task-meta-p",
        json.dumps(
            {"status": "SUCCESS", "children": [[["t", None], None], [["s2", None], None]]}
        ).encode(),
        state="SUCCESS",
        task_id="p",
    )
    html = client.get("/task?id=t").text
    assert "shop.add" in html and "secret-arg" in html
    kinds = re.findall(r'<tr data-kind="(\w+)">', html)
    assert kinds[:3] == ["enqueued", "claimed", "checkpoint"] and kinds.count("claimed") == 2
    leases = re.search(r'id="leases">(.*?)</table>', html, flags=re.S)
    assert leases
    assert "host-a:1:aa" in leases.group(1) and "host-b:2:bb" in leases.group(1)
    assert "expired or taken over" in leases.group(1)
    diffs = re.search(r'id="checkpoints">(.*?)</ol>', html, flags=re.S)
    assert diffs
    assert '<li class="added"><code>page</code>' in diffs.group(1)
    assert '<li class="changed"><code>cursor</code>: <code>&#34;x&#34;</code> → <code>null' in (
        diffs.group(1)
    )
    assert 'id="steps"' in html and "charge" in html and "succeeded" in html
    assert "ValueError: boom" in html and 'class="traceback"' in html
    assert "/task?id=p" in html and "/task?id=root-1" in html and "g1" in html
    assert "/task?id=s2" in html  # a sibling: the parent's other child
    fragment = client.get("/fragments/task?id=t").text
    assert "<html" not in fragment and 'id="timeline"' in fragment
    assert client.get("/task?id=nope").status_code == 404


def test_a_groups_members_are_siblings_without_a_parent(store: Store, client: TestClient) -> None:
    """A group started by a client has no parent result to list its children: its members
    are found by the group id their task records keep, after their messages are acked."""
    for task_id in ("g-a", "g-b", "g-c"):
        enqueue(store, task_id, group="grp-1")
    enqueue(store, "alone")
    for msg in store.claim(["q"], "w:1:x", lease_ms=LEASE, limit=3):
        assert store.ack([msg.fence]) == {msg.id}
    html = client.get("/task?id=g-b").text
    assert "/task?id=g-a" in html and "/task?id=g-c" in html
    assert "/task?id=alone" not in html and "grp-1" in html
    assert "shop.add" in html  # the name, from the task record
    assert Admin(store.engine.url, store=store).group("grp-1") == ["g-a", "g-b", "g-c"]


def test_redact_args_hides_arguments(store: Store, admin: Admin) -> None:
    enqueue(store, "t", args=["card-4242"])
    with TestClient(create_app(admin, token=TOKEN, redact_args=True)) as c:
        html = c.get("/task?id=t").text
    assert "card-4242" not in html and "(redacted)" in html


def test_runs_and_the_run_holder(store: Store, client: TestClient) -> None:
    enqueue(store, "a", run_id="order-7")
    enqueue(store, "b", run_id="order-7")
    enqueue(store, "solo")
    held = deliver(store, "host-a:1:aa")
    assert held.task_id == "a"
    html = client.get("/runs").text
    assert "order-7" in html and "host-a:1:aa" in html and "solo" not in html
    run = client.get("/run?id=order-7").text
    assert run.index('data-task="a"') < run.index('data-task="b"')
    assert "Held by message" in run and "host-a:1:aa" in run


def test_failed_waiting_paused_and_schedules_lists(
    store: Store, admin: Admin, client: TestClient, clock: FakeClock
) -> None:
    enqueue(store, "poison", max_attempts=1)
    deliver(store)
    clock.advance(LEASE)
    store.claim(["q"], "w", lease_ms=LEASE)
    enqueue(store, "ask")
    ctx = deliver(store)
    with pytest.raises(WaitingForPerson):
        ctx.wait_for_approval("Ship order 7?", amount=12)
    enqueue(store, "hold")
    admin.pause("hold")
    admin.add_schedule("nightly", "shop.add", every=3600, check_task=False)
    failed = client.get("/failed").text
    assert 'data-task="poison"' in failed and 'name="ids" value="poison"' in failed
    waiting = client.get("/waiting").text
    assert "Ship order 7?" in waiting and 'data-action="approve"' in waiting
    assert 'name="reason"' in waiting
    paused = client.get("/paused").text
    assert 'data-task="hold"' in paused and "action=resume" in paused
    schedules = client.get("/schedules").text
    assert 'data-schedule="nightly"' in schedules and "action=disable" in schedules
    for kind in ("failed", "waiting", "paused", "schedules"):
        assert client.get(f"/fragments/{kind}").status_code == 200


def test_read_only_pages_offer_no_actions(store: Store, admin: Admin) -> None:
    enqueue(store, "t")
    with TestClient(create_app(admin, read_only=True, token=TOKEN)) as c:
        html = c.get("/task?id=t").text
        assert "action=pause" not in html and "read-only" in html


@pytest.mark.pg
def test_the_database_password_is_never_shown(pg_database_url: str) -> None:
    from sqlalchemy.engine import make_url

    from conftest import unique_prefix

    url = make_url(pg_database_url).set(password="hunter2-secret")
    raw = url.render_as_string(hide_password=False)
    admin = Admin(raw, store=Store(raw, table_prefix=unique_prefix()))
    with TestClient(create_app(admin, token=TOKEN)) as c:
        page = c.get("/task?id=missing")
    assert page.status_code == 404
    assert "hunter2-secret" not in page.text and "***" in page.text
    assert TOKEN not in page.text


def test_time_range_bounds_beyond_the_clock_slack(
    store: Store, admin: Admin, clock: FakeClock
) -> None:
    views = AdminViews(admin)
    marks = {}
    for task_id in ("a", "b", "c", "d"):
        marks[task_id] = clock()
        enqueue(store, task_id)
        clock.advance(180_000)
    assert [r.task_id for r in views.task_page(since_ms=marks["b"]).rows] == ["d", "c", "b"]
    assert [r.task_id for r in views.task_page(until_ms=marks["c"]).rows] == ["b", "a"]
    both = views.task_page(since_ms=marks["b"], until_ms=marks["d"])
    assert [r.task_id for r in both.rows] == ["c", "b"]
    assert views.task_page(since_ms=clock()).rows == []


def test_a_database_without_the_schema_is_a_clear_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    with pytest.raises(SchemaMissing, match="sqlease migrate"):
        create_app(url, token=TOKEN)


def test_a_failing_database_is_a_clear_page(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shop.db'}"
    store = Store(url)
    admin = Admin(url, store=store)
    with TestClient(create_app(admin, token=TOKEN), raise_server_exceptions=False) as c:
        assert c.get("/").status_code == 200
        with store.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {store.tables.messages.name}")
        page = c.get("/tasks?state=queued")
    assert page.status_code == 503
    assert "the database did not answer: no such table" in page.text


def test_the_succeeded_filter_lists_finished_tasks(store: Store, client: TestClient) -> None:
    """A succeeded task has no message left: the list comes from its result and task row."""
    enqueue(store, "done-1", name="shop.ship")
    enqueue(store, "still-queued")
    ctx = deliver(store)
    assert ctx.fence is not None
    ResultStore(store).put(
        "celery-task-meta-done-1",
        json.dumps({"status": "SUCCESS", "result": 3, "task_id": "done-1"}).encode(),
        state="SUCCESS",
        task_id="done-1",
    )
    store.ack([ctx.fence])
    html = client.get("/tasks?state=succeeded").text
    assert html.count('data-task="') == 1 and 'data-task="done-1"' in html
    assert "shop.ship" in html
    assert client.get("/tasks?state=succeeded&name=shop.other").text.count('data-task="') == 0
