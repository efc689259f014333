"""The docs against the code: every name, option, verb and link the docs mention exists.

Fast, no database. What is checked:

- dotted names (``sqlease.X``, ``sqlease.mod.X``, ``sqlease.mod:X``) resolve, and name only
  public modules;
- the option table of ``docs/reference/transport-options.md`` lists exactly the options
  ``sqlease.options`` accepts; every option named elsewhere (keys of a
  ``broker_transport_options`` dict in a code block, ``broker_transport_options["…"]``,
  ```name``` written as an option) is a real one, or another broker's option that the
  reference lists as ignored;
- every ``sqlease VERB`` (in code blocks and inline code) is a verb of the CLI's parser, and
  every flag written after a verb is one of that verb's flags;
- ``docs/reference/python-api.md`` documents every name in ``sqlease.__all__``,
  ``transport-options.md`` every option, ``cli.md`` every verb and flag;
- the error tree drawn in ``reference/errors.md`` (and in ``sqlease.errors``' docstring) is
  the tree of the classes, with their other bases;
- every relative link (CHANGELOG.md's too) points to an existing file, and to an existing
  heading or anchor;
- no page but CHANGELOG.md tells history (sessions, commits) or cites DESIGN.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import textwrap
from functools import cache
from pathlib import Path

import click
import pytest

import sqlease
from sqlease import cli, options

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"

#: The modules users may import; the docs name no other ``sqlease.<module>``.
PUBLIC_MODULES = frozenset(
    {
        "transport",
        "contrib",
        "pytest_plugin",
        "beat",
        "backend",
        "cli",
        "errors",
        "testing",
        "store",
        "admin",
        "task_context",
        "transactions",
        "options",
        "urls",
        "revokes",
        "delivery",
        "types",
        "metrics",
        "ui",
    }
)
#: Names that look dotted but are not Python: file names.
NOT_NAMES = frozenset({"sqlease.db"})
#: Names the docs mark as planned (none today). A planned name must say so where it is used.
PLANNED: frozenset[str] = frozenset()


def doc_files() -> list[Path]:
    """Every page checked: the docs, the README, the examples' READMEs."""
    files = sorted(DOCS.rglob("*.md"))
    files += [ROOT / "README.md", ROOT / "examples" / "README.md"]
    files += sorted((ROOT / "examples").glob("*/README.md"))
    return files


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@cache
def text_of(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)


def inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(text))


# ---- (a) dotted names -------------------------------------------------------------------

DOTTED = re.compile(
    r"(?<![\w/.+-])sqlease((?:\.[A-Za-z_]\w*)+)(?::([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*))?"
)


def dotted_names(text: str) -> set[str]:
    found = set()
    for match in DOTTED.finditer(text):
        name = "sqlease" + match.group(1) + (f":{match.group(2)}" if match.group(2) else "")
        if name not in NOT_NAMES:
            found.add(name)
    return found


def resolve(name: str) -> object:
    """Import the longest module prefix of ``name``, then getattr the rest."""
    module_part, _, colon_attr = name.partition(":")
    parts = module_part.split(".")
    obj: object = None
    rest: list[str] = []
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        rest = parts[cut:]
        break
    if colon_attr:
        if rest:
            raise AttributeError(f"{name}: ':' must follow a module")
        rest = colon_attr.split(".")
    for attr in rest:
        obj = getattr(obj, attr)
    return obj


def all_dotted() -> list[tuple[str, str]]:
    return sorted(
        {(rel(path), name) for path in doc_files() for name in dotted_names(text_of(path))}
    )


@pytest.mark.parametrize(("page", "name"), all_dotted())
def test_dotted_name_resolves(page: str, name: str) -> None:
    if name in PLANNED:
        return
    module = name.split(":")[0].split(".")
    if len(module) > 1 and importlib.util.find_spec(".".join(module[:2])) is not None:
        assert module[1] in PUBLIC_MODULES, f"{page} names the internal module sqlease.{module[1]}"
    try:
        resolve(name)
    except (AttributeError, ImportError) as exc:
        pytest.fail(f"{page} names {name}, which does not exist: {exc}")


# ---- (b) transport options ----------------------------------------------------------------

OPTIONS = frozenset(f.name for f in dataclasses.fields(options.TransportOptions))
#: Options Kombu or Celery read from the same mapping: accepted by sqlease without a warning.
GENERIC = frozenset(getattr(options, "_GENERIC", ()))


def option_table() -> set[str]:
    """The first column of the table under ``## Options`` in the options reference."""
    text = text_of(REFERENCE / "transport-options.md")
    section = text.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in section.splitlines():
        cell = re.match(r"\|\s*`([a-z_]+)`\s*\|", line)
        if cell:
            names.add(cell.group(1))
    return names


def test_the_option_table_lists_exactly_the_options() -> None:
    listed = option_table()
    assert listed - OPTIONS == set(), f"not options of sqlease.options: {sorted(listed - OPTIONS)}"
    assert OPTIONS - listed == set(), f"options not in the table: {sorted(OPTIONS - listed)}"


def options_written(text: str) -> set[str]:
    """Options as the docs write them: dict keys in a code block that sets transport options,
    ``…transport_options["name"]``, and ```name``` followed by "option"."""
    names = set()
    for block in code_blocks(text):
        for setting in re.finditer(r"transport_options\s*=\s*\{(.*?)\}", block, flags=re.S):
            names.update(re.findall(r"[\"']([A-Za-z_]\w*)[\"']\s*:", setting.group(1)))
    names.update(re.findall(r"transport_options\[\s*[\"']([A-Za-z_]\w*)[\"']\s*\]", text))
    body = prose(text)
    names.update(re.findall(r"`([a-z_]+)`(?: transport)? option\b", body))
    names.update(re.findall(r"\boption `([a-z_]+)`", body))
    # `auto_migrate: False`, `maintenance_interval: 0`: a snake_case name set to a value
    # (names without "_" are too often something else, such as a count: `waiting: 2`).
    names.update(re.findall(r"`([a-z]+_[a-z_]+):\s*(?:True|False|\d[\d.]*|\"[^\"]*\")`", body))
    return names


def foreign_options() -> set[str]:
    """Other brokers' options, which sqlease ignores: the names the options reference lists
    under "Options from other brokers". The docs may mention these, and only these."""
    text = text_of(REFERENCE / "transport-options.md")
    section = text.split("\n## Options from other brokers\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`([a-z_]+)`", section)) - OPTIONS - GENERIC


def test_foreign_options_are_found() -> None:
    assert {"visibility_timeout", "global_keyprefix", "fanout_prefix"} <= foreign_options()


@pytest.mark.parametrize("page", [rel(p) for p in doc_files()])
def test_options_named_in_the_docs_exist(page: str) -> None:
    named = options_written(text_of(ROOT / page))
    wrong = named - OPTIONS - GENERIC - foreign_options()
    assert not wrong, f"{page} names transport options that do not exist: {sorted(wrong)}"


# ---- (c) CLI verbs -------------------------------------------------------------------------


def verbs() -> dict[str, click.Command]:
    """The verbs of the click group ``sqlease.cli.main`` runs."""
    assert isinstance(cli.cli, click.Group), "the sqlease command has no subcommands"
    return dict(cli.cli.commands)


def _option_strings(command: click.Command) -> set[str]:
    return {
        s
        for p in command.params
        if isinstance(p, click.Option)
        for s in (*p.opts, *p.secondary_opts)
    }


def global_flags() -> set[str]:
    return _option_strings(cli.cli) | {"-h", "--help"}


def flags_of(command: click.Command) -> set[str]:
    """A verb's flags, and those of its own verbs (``schedules add --every``)."""
    found = _option_strings(command)
    if isinstance(command, click.Group):
        for nested in command.commands.values():
            found |= flags_of(nested)
    return found


COMMAND = re.compile(r"^(?:\$\s+)?(?:[\w./-]*python3?\s+-m\s+|[\w./-]*/)?sqlease\s+(.*)$")


def commands(text: str) -> list[list[str]]:
    """The ``sqlease …`` command lines: code-block lines and inline code that start with
    ``sqlease`` (or ``python -m sqlease``), as tokens after the program name."""
    lines = [line.strip() for block in code_blocks(text) for line in block.splitlines()]
    lines += [span.strip() for span in inline_code(text)]
    found = []
    for line in lines:
        line = line.split(" #", 1)[0]  # a shell comment
        if ": " in line or "; " in line:
            continue  # a log message ("sqlease lease lost: …"), not a command
        match = COMMAND.match(line)
        if match:
            found.append(match.group(1).split())
    return found


def verb_and_flags(tokens: list[str]) -> tuple[str | None, list[str]]:
    """The verb (None for a synopsis line such as ``[--url URL] … VERB``) and the flags
    written after it."""
    takes_value = {"--url", "--table-prefix"}
    i = 0
    while i < len(tokens) and tokens[i].startswith("--"):
        flag = tokens[i].split("=", 1)[0]
        i += 2 if flag in takes_value and "=" not in tokens[i] else 1
    if i >= len(tokens) or not re.fullmatch(r"[a-z]+", tokens[i]):
        return None, []
    flags = [t.split("=", 1)[0] for t in tokens[i + 1 :] if re.fullmatch(r"--[a-z-]+(=.*)?", t)]
    return tokens[i], flags


def all_commands() -> list[tuple[str, str, tuple[str, ...]]]:
    found = set()
    for path in doc_files():
        for tokens in commands(text_of(path)):
            verb, flags = verb_and_flags(tokens)
            if verb is not None:
                found.add((rel(path), verb, tuple(flags)))
    return sorted(found)


@pytest.mark.parametrize(("page", "verb", "flags"), all_commands())
def test_cli_verbs_and_flags_in_the_docs_exist(page: str, verb: str, flags: tuple[str]) -> None:
    known = verbs()
    assert verb in known, f"{page}: 'sqlease {verb}' is not a verb (verbs: {sorted(known)})"
    allowed = flags_of(known[verb]) | global_flags()
    wrong = set(flags) - allowed
    assert not wrong, f"{page}: 'sqlease {verb}' has no flag {sorted(wrong)}"


def test_the_docs_mention_commands() -> None:
    # Guards the extraction itself: if it found nothing, the test above would check nothing.
    assert {verb for _, verb, _ in all_commands()} >= {"status", "show", "requeue", "maintain"}


# ---- (d) the reference pages are complete ------------------------------------------------


def test_python_api_documents_every_public_name() -> None:
    text = text_of(REFERENCE / "python-api.md")
    missing = [
        name
        for name in sqlease.__all__
        if not re.search(rf"`(?:sqlease\.)?{re.escape(name)}[`(]", text)
    ]
    assert not missing, f"reference/python-api.md does not document {missing}"


def test_errors_reference_lists_every_public_error() -> None:
    text = text_of(REFERENCE / "errors.md")
    errors = [
        name
        for name in sqlease.__all__
        if isinstance(getattr(sqlease, name), type)
        and issubclass(getattr(sqlease, name), BaseException)
    ]
    missing = [name for name in errors if f"`{name}`" not in text]
    assert not missing, f"reference/errors.md does not list {missing}"


def _drawn_tree(block: str) -> dict[str, tuple[str | None, tuple[str, ...]]]:
    """The error tree drawn in ``block``: each class with its parent in the tree and the
    other bases its line names (``(also ValueError)``)."""
    drawn: dict[str, tuple[str | None, tuple[str, ...]]] = {}
    parents: list[str] = []
    for line in block.splitlines():
        found = re.match(r"^((?:[│ ] {3}|[├└]── )*)(\w+)(?: \(also ([\w ]+)\))?", line)
        assert found, f"not a line of the tree: {line!r}"
        depth = len(found.group(1)) // 4
        parents[depth:] = [found.group(2)]
        also = tuple(found.group(3).split()[-1:]) if found.group(3) else ()
        drawn[found.group(2)] = (parents[depth - 1] if depth else None, also)
    return drawn


def test_the_errors_tree_is_the_class_tree() -> None:
    """reference/errors.md and sqlease.errors' docstring draw exactly the classes of
    sqlease.errors, each under its parent, with its other bases."""
    from sqlease import errors

    actual: dict[str, tuple[str | None, tuple[str, ...]]] = {}
    for name, cls in vars(errors).items():
        if isinstance(cls, type) and issubclass(cls, errors.SqleaseError):
            ours = [b for b in cls.__bases__ if issubclass(b, errors.SqleaseError)]
            others = tuple(
                b.__name__ for b in cls.__bases__ if b not in ours and b is not Exception
            )
            actual[name] = (ours[0].__name__ if ours else None, others)
    page = next(b for b in code_blocks(text_of(REFERENCE / "errors.md")) if "├──" in b)
    assert _drawn_tree(page) == actual
    literal = (errors.__doc__ or "").split("::\n\n", 1)[1].split("\n\n", 1)[0]
    assert _drawn_tree(textwrap.dedent(literal)) == actual


def test_options_reference_documents_every_option() -> None:
    text = text_of(REFERENCE / "transport-options.md")
    missing = sorted(name for name in OPTIONS if f"`{name}`" not in text)
    assert not missing, f"reference/transport-options.md does not document {missing}"


def test_cli_reference_documents_every_verb_and_flag() -> None:
    text = text_of(REFERENCE / "cli.md")
    headings = re.findall(r"^## (.*)$", text, flags=re.M)
    for verb, parser in verbs().items():
        assert any(f"`{verb}`" in h for h in headings), f"reference/cli.md: no section for {verb}"
        for flag in flags_of(parser) - {"-h", "--help"}:
            assert f"`{flag}" in text or f" {flag}" in text, (
                f"reference/cli.md does not document {verb}'s {flag}"
            )


# ---- (e) links ----------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    text = prose(text_of(path))
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.*)$", text, flags=re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    found.update(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))
    return frozenset(found)


def links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", prose(text))


def all_links() -> list[tuple[str, str]]:
    found = set()
    for path in [*doc_files(), ROOT / "CHANGELOG.md"]:
        for target in links(text_of(path)):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                found.add((rel(path), target))
    return sorted(found)


@pytest.mark.parametrize(("page", "target"), all_links())
def test_relative_link_resolves(page: str, target: str) -> None:
    file_part, _, anchor = target.partition("#")
    source = ROOT / page
    dest = (source.parent / file_part).resolve() if file_part else source
    assert dest.exists(), f"{page} links to {target}: {file_part} does not exist"
    if anchor and dest.suffix == ".md":
        assert anchor in anchors(dest), f"{page} links to {target}: no such heading in {rel(dest)}"


# ---- (f) reference, not history ------------------------------------------------------------

HISTORY = re.compile(
    r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth)"
    r" session\b|\bcommits? `?[0-9a-f]{7,40}\b|(?-i:\bDESIGN\b)"
    # a bare commit hash or date in the text (not inside a file name such as a results file)
    r"|(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w.-])"
    r"|(?<![\w/.-])20\d\d-\d\d-\d\d(?![\w.-])",
    flags=re.I,
)


@pytest.mark.parametrize("page", [rel(p) for p in doc_files()])
def test_pages_tell_no_history(page: str) -> None:
    found = [m.group(0) for m in HISTORY.finditer(text_of(ROOT / page))]
    assert not found, f"{page} tells history or cites a file outside the repository: {found}"


def _section(page: str, heading: str) -> str:
    text = (DOCS / page).read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_the_store_reference_names_only_real_members() -> None:
    """Every name the Store section shows as a method, property or attribute is one."""
    from sqlease.store import Store

    section = _section("reference/python-api.md", "Store")
    # The methods table's first column, and the paragraph that lists the remaining ones.
    named = set(re.findall(r"(?m)^\| `([a-z_][a-z0-9_]*)", section))
    remaining = section[section.index("The remaining public methods") :]
    named |= set(re.findall(r"`([a-z_][a-z0-9_]*)`", remaining.split("\n\n")[0]))
    instance_only = {"driver", "engine", "tables", "sql", "clock"}
    missing = sorted(n for n in named - instance_only if not hasattr(Store, n))
    assert len(named) > 20  # the table was read
    assert not missing, (
        f"docs/reference/python-api.md names Store members that do not exist: {missing}"
    )
