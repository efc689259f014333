"""The dashboard in a real headless Chromium (Debian's chromium and chromedriver), against a
live server and an in-process Celery worker, on SQLite and PostgreSQL: the overview, a
task's timeline, approving a waiting task and seeing it finish, requeueing an exhausted
task, and actions refused without the token. Screenshots go to the test's folder, and to
docs/images when SQLEASE_UI_SCREENSHOTS is set."""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import REQUIRE_PG, unique_prefix
from sqlease import Admin, Store

from .helpers import TOKEN, enqueue

CHROMIUM = "/usr/bin/chromium"
DRIVER = "/usr/bin/chromedriver"
DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
    if REQUIRE_PG:  # CI installs them (.ci/run): a missing browser is a failure there
        raise RuntimeError(f"{CHROMIUM} and {DRIVER} are needed for the browser tests")
    pytest.skip("Debian's chromium and chromium-driver are not installed", allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Live:
    def __init__(self, base: str, admin: Admin, store: Store, shots: Path) -> None:
        self.base, self.admin, self.store, self.shots = base, admin, store, shots
        self.base_url_is_sqlite = True

    def shot(self, driver: Any, name: str) -> None:
        path = self.shots / f"ui-{name}.png"
        driver.save_screenshot(str(path))
        # The docs show the SQLite run's pages (a PostgreSQL run's look the same).
        if os.environ.get("SQLEASE_UI_SCREENSHOTS") and self.base_url_is_sqlite:
            DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, DOCS_IMAGES / path.name)


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.pg)])
def live(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Live]:
    import uvicorn
    from celery.contrib.testing.worker import start_worker

    from sqlease.ui import create_app

    from .browser_app import make_app

    folder = tmp_path_factory.mktemp("browser")
    if request.param == "sqlite":
        url = f"sqlite:///{folder / 'shop.db'}"
    else:
        url = request.getfixturevalue("pg_database_url")
    prefix = unique_prefix()
    store = Store(url, table_prefix=prefix)
    admin = Admin(url, store=store)
    app = make_app(url, prefix)
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(admin, token=TOKEN, lease_seconds=60),
            host="127.0.0.1",
            port=port,
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the dashboard did not start"
        time.sleep(0.02)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
            live = Live(f"http://127.0.0.1:{port}", admin, store, folder)
            live.base_url_is_sqlite = request.param == "sqlite"
            live.app = app  # type: ignore[attr-defined]
            yield live
    finally:
        server.should_exit = True
        thread.join(10)
        app.close()


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        "--lang=en",
    ):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield browser
    finally:
        browser.quit()


def until(driver: Any, predicate: Any, timeout: float = 30) -> Any:
    return WebDriverWait(
        driver, timeout, poll_frequency=0.1, ignored_exceptions=[StaleElementReferenceException]
    ).until(predicate)


def click(driver: Any, css: str) -> None:
    """Click what ``css`` finds, again if a live refresh replaced it in between."""

    def clicked(d: Any) -> bool:
        d.find_element(By.CSS_SELECTOR, css).click()
        return True

    until(driver, clicked)


def text_of(driver: Any, css: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def wait_state(admin: Admin, task_id: str, state: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while admin.task(task_id).state != state:
        assert time.monotonic() < deadline, f"{task_id} never became {state}"
        time.sleep(0.05)


def test_overview_and_a_tasks_timeline(live: Live, driver: Any) -> None:
    results = [live.app.tasks["shop.add"].delay(i, i) for i in range(8)]  # type: ignore[attr-defined]
    assert [r.get(timeout=20) for r in results] == [2 * i for i in range(8)]
    enqueue(live.store, "later-1", queue="celery", delay_ms=3_600_000)
    for i in range(3):  # a queue no worker of this test consumes; one task held by hand
        enqueue(live.store, f"report-{i}", queue="reports")
    live.store.claim(["reports"], "web-2:4242:9f3c", lease_ms=60_000)
    driver.get(live.base + "/")
    until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#queues tr[data-queue=celery]"))
    assert "Overview" in driver.title
    assert "web-2:4242:9f3c" in text_of(driver, "#workers")
    # 8 finished: the chart's newest bars say so (the live fragment keeps them current).
    titles = " ".join(
        t.get_attribute("textContent")
        for t in driver.find_elements(By.CSS_SELECTOR, "svg.chart g title")
    )
    assert sum(int(n) for n in re.findall(r"(\d+) finished", titles)) >= 8
    live.shot(driver, "overview")
    driver.get(live.base + "/task?id=" + results[0].id)
    until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#timeline tr[data-kind]"))
    kinds = [
        r.get_attribute("data-kind")
        for r in driver.find_elements(By.CSS_SELECTOR, "#timeline tr[data-kind]")
    ]
    assert kinds[0] == "enqueued" and "claimed" in kinds
    assert text_of(driver, "#task-state") == "succeeded"
    assert "shop.add" in text_of(driver, ".summary")
    # Times are shown in local ISO form and relative to now by the page's script.
    first = driver.find_element(By.CSS_SELECTOR, "#timeline time")
    assert first.get_attribute("title").endswith("+00:00")  # the UTC it was sent as
    assert "ago)" in first.text or "just now)" in first.text
    live.shot(driver, "task")


def test_approve_a_waiting_task_and_see_it_finish(live: Live, driver: Any) -> None:
    result = live.app.tasks["shop.wait_then_ship"].delay(7)  # type: ignore[attr-defined]
    wait_state(live.admin, result.id, "waiting_approval")
    driver.delete_all_cookies()
    driver.get(live.base + "/waiting")
    until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, f"article[data-task='{result.id}']"))
    assert "Ship order 7?" in text_of(driver, f"article[data-task='{result.id}']")
    live.shot(driver, "waiting")
    form = f"article[data-task='{result.id}'] form[data-action=approve]"
    driver.find_element(By.CSS_SELECTOR, form + " input[name=note]").send_keys("looks right")
    click(driver, form + " button")
    # Not logged in: the login form first, then back to the confirmation.
    until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#login"))
    driver.find_element(By.NAME, "token").send_keys(TOKEN)
    driver.find_element(By.CSS_SELECTOR, "#login button").click()
    # The confirmation keeps the note typed in the list.
    note = until(driver, lambda d: d.find_element(By.CSS_SELECTOR, "#confirm input[name=note]"))
    assert note.get_attribute("value") == "looks right"
    live.shot(driver, "approve")
    driver.find_element(By.CSS_SELECTOR, "#confirm button").click()
    until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#flash"))
    # The worker runs it again with the answer; the live fragment shows it finish.
    until(driver, lambda d: text_of(d, "#task-state") == "succeeded", timeout=30)
    assert result.get(timeout=10) == {"order": 7, "shipped": True, "attempt": 2}
    assert live.admin.task(result.id).waiting is None
    assert "approved" in text_of(driver, "#timeline")
    live.shot(driver, "approved")


def test_requeue_an_exhausted_task(live: Live, driver: Any) -> None:
    store = live.store
    enqueue(store, "poison-1", queue="poison", max_attempts=1)
    store.claim(["poison"], "host-x:1:dead", lease_ms=1)  # its worker dies
    time.sleep(0.01)
    assert store.claim(["poison"], "host-y:2:late", lease_ms=1) == []
    wait_state(live.admin, "poison-1", "failed")
    driver.get(live.base + "/login?next=/failed")
    driver.find_element(By.NAME, "token").send_keys(TOKEN)
    driver.find_element(By.CSS_SELECTOR, "#login button").click()
    # Logged in and back on the list (a navigation started before the login's redirect
    # landed would race it).
    until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#requeue-many"))
    click(driver, "input[value='poison-1']")
    until(
        driver, lambda d: d.find_element(By.CSS_SELECTOR, "input[value='poison-1']").is_selected()
    )
    live.shot(driver, "failed")
    driver.find_element(By.CSS_SELECTOR, "#requeue-many button").click()
    until(driver, lambda d: "Requeue 1 task?" in d.title or d.find_elements(By.ID, "confirm"))
    driver.find_element(By.CSS_SELECTOR, "#confirm button").click()
    until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#flash"))
    assert "requeued 1" in text_of(driver, "#flash")
    assert live.admin.task("poison-1").state == "queued"


def test_actions_are_refused_without_the_token(live: Live, driver: Any) -> None:
    enqueue(live.store, "keep-1", queue="poison")
    driver.delete_all_cookies()
    driver.get(live.base + "/task/do?id=keep-1&action=cancel")
    until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#login"))
    driver.find_element(By.NAME, "token").send_keys("a-guess")
    driver.find_element(By.CSS_SELECTOR, "#login button").click()
    until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#error"))
    assert "not the one" in text_of(driver, "#error")
    live.shot(driver, "refused")
    # A forged POST from the page's own script, without the CSRF value, is refused too.
    status = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch('/task/do', {method: 'POST', body: new URLSearchParams("
        "{id: 'keep-1', action: 'cancel'}), headers: {authorization: 'Bearer " + TOKEN + "'}})"
        ".then(r => done(r.status));"
    )
    assert status == 403
    assert live.admin.task("keep-1").state == "queued"
