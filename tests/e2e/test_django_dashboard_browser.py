"""The Django example's dashboard in a real headless Chromium: the shop project
(examples/django_shop, ``manage.py runserver``) on SQLite and on PostgreSQL; a visitor opening
/sqlease/ is sent to Django's admin sign-in, signs in as staff, finds a task on the task list,
pauses it from its page (a POST carrying Django's CSRF token), and the task is paused in the
database with the timeline event the command line writes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from conftest import PG_URL, REQUIRE_PG, _admin_engine
from sqlease import Admin, Store

SHOP = Path(__file__).resolve().parents[2] / "examples" / "django_shop"
CHROMIUM = "/usr/bin/chromium"
DRIVER = "/usr/bin/chromedriver"
PASSWORD = "not-a-real-password-1"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

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


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.pg)])
def shop(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The shop's database (SQLite file, or a PostgreSQL database of its own), migrated, with
    a staff user; yields (environment's database URL for sqlease, server base URL)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", SHOP_DIR=str(tmp_path))
    env.pop("PYTEST_CURRENT_TEST", None)
    database = None
    if request.param == "postgresql":
        request.getfixturevalue("pg_database_url")  # skips when the server is not there
        database = f"sqlease_shopui_{uuid.uuid4().hex[:8]}"
        with _admin_engine().connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{database}"'))
        url = make_url(PG_URL).set(database=database).render_as_string(hide_password=False)
        env["SHOP_DATABASE_URL"] = url
    else:
        url = f"sqlite:///{tmp_path / 'django_shop.db'}"
    manage = [sys.executable, str(SHOP / "manage.py")]

    def run(*args: str, **extra: str) -> None:
        done = subprocess.run(
            [*manage, *args],
            cwd=SHOP,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr

    server = None
    log = (tmp_path / "server.log").open("wb")
    try:
        run("migrate", "--noinput")
        run(
            "createsuperuser",
            "--noinput",
            "--username",
            "boss",
            "--email",
            "boss@example.com",
            DJANGO_SUPERUSER_PASSWORD=PASSWORD,
        )
        port = _free_port()
        server = subprocess.Popen(
            [*manage, "runserver", f"127.0.0.1:{port}", "--noreload"],
            cwd=SHOP,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "server.log").read_text()
                assert time.monotonic() < deadline, "the shop's server did not start"
                time.sleep(0.1)
        yield url, f"http://127.0.0.1:{port}"
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
        log.close()
        if database is not None:
            from sqlease._db.engine import dispose_all

            dispose_all(close=True)
            with _admin_engine().connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))


@pytest.fixture
def driver() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
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


def test_staff_sign_in_to_django_and_pause_a_task(shop: tuple[str, str], driver: Any) -> None:
    url, base = shop
    store = Store(url, auto_migrate=False)  # the tables manage.py migrate made
    store.enqueue("celery", "{}", task_id="order-7", task_name="shop.tasks.ship_order")
    admin = Admin(url, store=store)
    driver.get(base + "/sqlease/tasks")
    # Not signed in: Django's admin sign-in, then back to the dashboard.
    until(driver, lambda d: d.find_elements(By.ID, "id_username"))
    assert "/admin/login/" in driver.current_url and "next=/sqlease/tasks" in driver.current_url
    driver.find_element(By.ID, "id_username").send_keys("boss")
    driver.find_element(By.ID, "id_password").send_keys(PASSWORD)
    driver.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "tr[data-task='order-7']"))
    assert driver.current_url == base + "/sqlease/tasks"
    assert "boss" in driver.find_element(By.CSS_SELECTOR, "header .who").text
    driver.find_element(By.CSS_SELECTOR, "tr[data-task='order-7'] a").click()
    until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#task-state"))
    assert driver.find_element(By.ID, "task-state").text == "queued"
    driver.find_element(By.CSS_SELECTOR, "a[data-action=pause]").click()
    confirm = until(driver, lambda d: d.find_element(By.CSS_SELECTOR, "#confirm"))
    assert confirm.find_element(By.NAME, "csrfmiddlewaretoken").get_attribute("value")
    confirm.find_element(By.CSS_SELECTOR, "button").click()
    until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#flash"))
    until(driver, lambda d: d.find_element(By.ID, "task-state").text == "paused")
    snapshot = admin.task("order-7")
    assert snapshot.state == "paused"
    assert snapshot.events[-1]["kind"] == "paused"
    store.engine.dispose()
