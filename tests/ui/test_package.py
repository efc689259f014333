"""The dashboard ships whole: every template and static file is package data (the wheel
carries it), and no page loads anything from another host."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import sqlease

PACKAGE = Path(sqlease.__file__).parent
ROOT = PACKAGE.parents[1]


def test_templates_and_static_files_are_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["sqlease"]
    files = [
        p.relative_to(PACKAGE).as_posix()
        for folder in ("ui/templates", "ui/static")
        for p in (PACKAGE / folder).rglob("*")
        if p.is_file()
    ]
    assert any(f.endswith(".html") for f in files) and any(f.endswith(".js") for f in files)
    missing = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert not missing, f"not in package-data: {missing}"


def test_no_asset_comes_from_another_host() -> None:
    for path in (PACKAGE / "ui").rglob("*"):
        if path.suffix in (".html", ".js", ".css"):
            text = path.read_text()
            assert not re.search(r"(?:src|href)=\"(?:https?:)?//", text), path
            assert "@import" not in text and "url(http" not in text, path


def test_extras_name_the_dashboard_dependencies() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = config["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[]", d)[0] for d in extras["ui"]}
    assert names == {"starlette", "jinja2", "uvicorn", "python-multipart", "prometheus-client"}
    test = {re.split(r"[<>=\[]", d)[0] for d in extras["test"]}
    assert names | {"selenium", "httpx2"} <= test
