"""Before/after benchmark of two versions of sqlease, paired in one run.

Each round runs, for each version, its OWN ``benchmarks/celery_bench.py --rounds 1`` on its
sqlease brokers (PostgreSQL, PostgreSQL ``publish-nowait``, SQLite) and its own
``benchmarks/store.py`` (claims + acks per second, SQLite and PostgreSQL); the order alternates
(before/after, then after/before, ...), and the Redis and RabbitMQ baselines run once per round,
between the two versions' celery_bench runs. Every benchmark subprocess makes fresh tables (a
table prefix per process; store.py: a database ``sqlease_bench_<pid>``) and fresh SQLite files
(under the run's temporary directory, removed at the end).

``--before REF`` is checked out into a temporary ``git worktree`` (removed at the end);
``--after`` is a REF (the same) or a PATH with ``src/`` and ``benchmarks/``, copied at the start
(edits made during the run are not measured). Each version runs on a throwaway venv whose
site-packages is the shared venv's (one set of dependencies) without its ``.pth`` files, so its
``src/`` is the only sqlease on the path, also for Celery's workers and store.py's processes
whatever PYTHONPATH they get (celery_bench up to fe52157 gives its workers
``PYTHONPATH=benchmarks/``, which imports the shared venv's editable install); PYTHONPATH puts
its ``src/`` and ``benchmarks/`` first. Each version's ``sqlease.__file__`` is printed.

    .venv/bin/python benchmarks/paired.py            # fe52157 vs this tree: 3 rounds, 10,000 tasks
    .venv/bin/python benchmarks/paired.py --before main --after ../other-tree --rounds 5
    nice -n 10 .venv/bin/python benchmarks/paired.py --quick --before HEAD   # validation, 1 round

Report: per metric (celery_bench's delay()/s, drain/s without and with results stored, start
and get() p50 per broker; store.py's tasks/s per backend, loop, processes P and batch B) each
round's ``before -> after``, their medians, and the median of the rounds' speed ratios
after/before (latencies: before/after, so below 1 always means slower), flagged ``<<`` below
0.95; then each version's ratios to Redis and RabbitMQ (celery_bench's, median of the rounds).
Raw numbers, per round and version:
``benchmarks/results/paired-<date>-<before>-<after>[-quick].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery_bench import RATIOS, ratios_of

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BASELINES = ["redis", "rabbitmq"]
#: celery_bench's measurements compared (False: a latency, lower is faster).
CELERY_KEYS = {
    "delay_per_s": ("delay()/s", True),
    "drain_per_s": ("drain/s", True),
    "drain_backend_per_s": ("drain/s, results stored", True),
    "start_p50_ms": ("start p50 ms", False),
    "get_p50_ms": ("get() p50 ms", False),
}
THRESHOLD = 0.95


@dataclass
class Version:
    name: str  # "before" or "after"
    label: str  # its commit (git describe for a tree)
    root: Path  # holds its src/ and benchmarks/
    python: Path = Path()
    brokers: tuple[str, ...] = ()  # its celery_bench's sqlease brokers
    seen: str = ""  # sqlease.__file__ as its benchmarks import it

    def run(self, script: str, argv: list[str], log: Path, pythonpath: bool = True) -> int:
        bench = self.root / "benchmarks"
        path = [str(self.root / "src"), str(bench)] if pythonpath else [str(bench)]
        # TMPDIR: the benchmarks' temporary directories (SQLite files) go with the run's.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), TMPDIR=str(log.parent))
        with log.open("a") as out:
            out.write(f"$ {script} {shlex.join(argv)}\n")
            out.flush()
            return subprocess.run(
                [str(self.python), script, *argv],
                cwd=bench,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                check=False,
            ).returncode


def git(*argv: str, cwd: Path = REPO) -> str:
    return subprocess.run(
        ["git", "-C", str(cwd), *argv], capture_output=True, text=True, check=True
    ).stdout.strip()


def materialise(name: str, spec: str, tmp: Path, worktrees: list[Path]) -> Version:
    root = tmp / name
    if (Path(spec) / "src" / "sqlease").is_dir():  # a tree: copy its code as it is now
        try:
            label = git("describe", "--always", "--dirty", cwd=Path(spec))
        except (subprocess.CalledProcessError, OSError):
            label = Path(spec).resolve().name
        skip = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
        for part in ("src", "benchmarks"):
            shutil.copytree(Path(spec) / part, root / part, ignore=skip)
        return Version(name, label, root)
    label = git("rev-parse", "--short", f"{spec}^{{commit}}")
    git("worktree", "add", "--detach", str(root), label)
    worktrees.append(root)
    return Version(name, label, root)


def interpreter(version: Version, tmp: Path) -> None:
    """A venv for ``version`` whose only paths are its src/ and the shared site-packages."""
    home = tmp / f"venv-{version.name}"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(home)
    shared = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    lib = home / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    (lib / "sqlease_paired.pth").write_text("\n".join([str(version.root / "src"), *shared]) + "\n")
    version.python = home / "bin" / "python"


def probe(version: Version, tmp: Path) -> None:
    """Check which sqlease the version's benchmarks and its workers import; its brokers."""
    out = tmp / f"probe-{version.name}.json"
    main = (
        "import json, pathlib, sys, sqlease, celery_bench; json.dump({'file': sqlease.__file__,"
        " 'brokers': [b.name for b in celery_bench.brokers(pathlib.Path('/nonexistent'), "
        "'x_')]}, open(sys.argv[1], 'w'))"
    )
    worker = "import sys, bench_app, sqlease; open(sys.argv[1], 'w').write(sqlease.__file__)"
    log = tmp / f"probe-{version.name}.log"
    for code, pythonpath in ((main, True), (worker, False)):
        if version.run("-c", [code, str(out)], log, pythonpath) != 0:
            raise SystemExit(f"{version.name}: import failed:\n{log.read_text()}")
        text = out.read_text()
        seen = json.loads(text) if pythonpath else {"file": text}
        if not Path(seen["file"]).resolve().is_relative_to((version.root / "src").resolve()):
            raise SystemExit(f"{version.name} imports {seen['file']}, not its own src/")
        if pythonpath:
            version.seen = seen["file"]
            version.brokers = tuple(b for b in seen["brokers"] if b.startswith("sqlease"))
        where = "benchmarks" if pythonpath else "workers (PYTHONPATH=benchmarks/ only)"
        print(f"{version.name} {version.label}: its {where} import {seen['file']}", flush=True)


def celery(
    version: Version, brokers: list[str], args: argparse.Namespace, tmp: Path, tag: str
) -> list[dict[str, Any]]:
    script = version.root / "benchmarks" / "celery_bench.py"
    out = tmp / f"{tag}-celery.json"
    argv = ["--rounds", "1", "--only", ",".join(brokers), "--tasks", str(args.tasks)]
    argv += ["--quick"] * args.quick
    if "--output" in script.read_text():
        argv += ["--output", str(out)]
    started = time.time()
    code = version.run(str(script), argv, tmp / f"{tag}.log")
    if not out.exists():  # a celery_bench without --output writes into its own results/
        done = [
            p
            for p in (script.parent / "results").glob("celery-*.json")
            if p.stat().st_mtime >= started
        ]
        out = max(done, key=lambda p: p.stat().st_mtime, default=out)
    if code or not out.exists():
        return failed(tag, code, tmp)
    return list(json.loads(out.read_text())["runs"])


def store(version: Version, args: argparse.Namespace, tmp: Path, tag: str) -> list[dict[str, Any]]:
    out = tmp / f"{tag}-store.json"
    argv = ["--output", str(out), "--label", f"paired {tag} {version.label}"]
    argv += ["--quick"] * args.quick + shlex.split(args.store_args)
    code = version.run(str(version.root / "benchmarks" / "store.py"), argv, tmp / f"{tag}.log")
    if code or not out.exists():
        return failed(tag, code, tmp)
    data = json.loads(out.read_text())
    measured = Path(data["environment"]["sqlease_path"])
    if not measured.is_relative_to((version.root / "src").resolve()):
        raise SystemExit(f"{tag}: store.py measured {measured}")
    return list(data["store_runs"])


def failed(tag: str, code: int, tmp: Path) -> list[dict[str, Any]]:
    """A benchmark that failed: its log's end on stderr, and no results (the run goes on)."""
    lines = (tmp / f"{tag}.log").read_text().splitlines()[-20:]
    print(f"  {tag}: exited {code}\n    " + "\n    ".join(lines), file=sys.stderr, flush=True)
    return []


def metrics(results: dict[str, Any]) -> dict[str, tuple[float, bool]]:
    """{metric: (value, higher is faster)} of one version's (or the baselines') round."""
    values: dict[str, list[float]] = {}
    faster: dict[str, bool] = {}
    for run in results.get("celery", []):
        for key, (label, up) in CELERY_KEYS.items():
            if run.get(key) is not None:
                values.setdefault(f"{run['broker']} {label}", []).append(run[key])
                faster[f"{run['broker']} {label}"] = up
    for run in results.get("store", []):
        name = (
            f"store {run['backend']} {run.get('mode', 'separate')} "
            f"P={run['processes']} B={run['batch']} tasks/s"
        )
        values.setdefault(name, []).append(run["tasks_per_s"])
        faster[name] = True
    return {k: (statistics.median(v), faster[k]) for k, v in values.items()}


def number(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def report(rounds: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    per = [{v: metrics(r.get(v, {})) for v in ("before", "after", "baselines")} for r in rounds]
    names = list(dict.fromkeys(k for p in per for v in ("before", "after") for k in p[v]))
    rows: list[dict[str, Any]] = []
    head = "".join(f"{f'round {i + 1}':>22}" for i in range(len(rounds)))
    print(
        f"\n{'metric':<42}{head}{'median before':>15}{'median after':>14}{'ratio':>8}"
        f"{'  (rounds: min-max)' if len(rounds) > 1 else ''}"
    )
    for name in names:
        pairs = [(p["before"].get(name, (None,))[0], p["after"].get(name, (None,))[0]) for p in per]
        up = next(p[v][name][1] for p in per for v in ("before", "after") if name in p[v])
        ratios = [(a / b if up else b / a) for b, a in pairs if a and b]
        row = {
            "metric": name,
            "higher_is_faster": up,
            "before": [b for b, _ in pairs],
            "after": [a for _, a in pairs],
            "ratios": [round(x, 3) for x in ratios],
        }
        for side in ("before", "after"):
            got = [x for x in row[side] if x is not None]
            row[f"median_{side}"] = statistics.median(got) if got else None
        ratios = row["ratios"]
        row["ratio"] = statistics.median(ratios) if ratios else None
        row["flag"] = row["ratio"] is not None and row["ratio"] < THRESHOLD
        rows.append(row)
        cells = "".join(f"{number(b) + ' -> ' + number(a):>22}" for b, a in pairs)
        print(
            f"{name:<42}{cells}{number(row['median_before']):>15}"
            f"{number(row['median_after']):>14}{number(row['ratio']):>8}"
            f"{f'  ({min(ratios):.2f}-{max(ratios):.2f})' if len(ratios) > 1 else ''}"
            f"{'  <<' if row['flag'] else ''}"
        )
    for name in dict.fromkeys(k for p in per for k in p["baselines"]):
        cells = "".join(f"{number(p['baselines'].get(name, (None,))[0]):>22}" for p in per)
        print(f"{name + ' (baseline)':<42}{cells}")
    # sqlease against the baselines: celery_bench's own ratios, per round and version.
    wanted = [r for r in RATIOS if r[2] in BASELINES]
    versus: dict[str, Any] = {}
    print(f"\n{'against Redis / RabbitMQ (median of rounds)':<42}{'before':>12}{'after':>12}")
    for name, *_ in wanted:
        versus[name] = {}
        for side in ("before", "after"):
            got = [
                ratios_of(
                    {
                        x["broker"]: x
                        for x in r[side]["celery"] + r.get("baselines", {}).get("celery", [])
                    }
                ).get(name)
                for r in rounds
            ]
            got = [x for x in got if x is not None]
            versus[name][side] = {"rounds": got, "median": statistics.median(got) if got else None}
        print(
            f"{name:<42}{number(versus[name]['before']['median']):>12}"
            f"{number(versus[name]['after']['median']):>12}"
        )
    flagged = [r["metric"] for r in rows if r["flag"]]
    print(
        f"\nratio = median of the rounds' after/before speed ratios; {len(flagged)} of "
        f"{len(rows)} below {THRESHOLD}{': ' + ', '.join(flagged) if flagged else ''}"
    )
    return rows, versus


def run_round(
    number: int,
    total: int,
    versions: dict[str, Version],
    brokers: list[str],
    args: argparse.Namespace,
    tmp: Path,
) -> dict[str, Any]:
    """celery_bench for each version with the baselines between them, then store.py for each;
    before first in odd rounds, after first in even ones."""
    order = ["before", "after"] if number % 2 else ["after", "before"]
    plan = [
        ("celery", order[0]),
        ("celery", "baselines"),
        ("celery", order[1]),
        ("store", order[0]),
        ("store", order[1]),
    ]
    if args.no_baselines:
        plan.remove(("celery", "baselines"))
    if args.no_store:
        plan = [step for step in plan if step[0] != "store"]
    result: dict[str, Any] = {"round": number, "order": order, "seconds": {}}
    for what, side in plan:
        tag, t0 = f"r{number}-{side}", time.monotonic()
        if side == "baselines":
            got = celery(versions["after"], BASELINES, args, tmp, tag)
        elif what == "celery":
            got = celery(versions[side], brokers, args, tmp, tag)
        else:
            got = store(versions[side], args, tmp, tag)
        result.setdefault(side, {"celery": [], "store": []})[what] = got
        result["seconds"][f"{side} {what}"] = secs = round(time.monotonic() - t0)
        print(f"[round {number}/{total}] {side:<9} {what:<7} {secs:>5} s", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--before", default="fe52157", help="a git ref of this repository")
    parser.add_argument("--after", default=str(REPO), help="a tree (PATH) or a git ref")
    parser.add_argument("--rounds", type=int, default=None, help="3; --quick: 1")
    parser.add_argument("--tasks", type=int, default=10_000, help="celery_bench --tasks")
    parser.add_argument("--brokers", default="", help="only these sqlease brokers (comma list)")
    parser.add_argument("--no-store", action="store_true", help="celery_bench only")
    parser.add_argument("--no-baselines", action="store_true", help="no Redis and RabbitMQ")
    parser.add_argument(
        "--quick", action="store_true", help="validation: celery_bench --quick and store.py --quick"
    )
    parser.add_argument(
        "--store-args",
        default="--repeat 1 --no-pgbench",
        help="more store.py options (the rounds repeat; pgbench does not depend on the version)",
    )
    args = parser.parse_args()
    rounds_wanted = args.rounds or (1 if args.quick else 3)
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="sqlease-paired-"))
    worktrees: list[Path] = []
    rounds: list[dict[str, Any]] = []
    try:
        versions = {
            "before": materialise("before", args.before, tmp, worktrees),
            "after": materialise("after", args.after, tmp, worktrees),
        }
        for version in versions.values():
            interpreter(version, tmp)
            probe(version, tmp)
        brokers = [b for b in versions["after"].brokers if b in versions["before"].brokers]
        if args.brokers:
            brokers = [b for b in brokers if b in args.brokers.split(",")]
        print(f"sqlease brokers: {', '.join(brokers)}", flush=True)
        for number in range(1, rounds_wanted + 1):
            rounds.append(run_round(number, rounds_wanted, versions, brokers, args, tmp))
        rows, versus = report(rounds)
    except BaseException:
        for log in sorted(tmp.glob("*.log")):
            print(
                f"--- {log.name} (last lines)\n" + "\n".join(log.read_text().splitlines()[-15:]),
                file=sys.stderr,
            )
        raise
    finally:
        for tree in worktrees:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False
            )
        shutil.rmtree(tmp, ignore_errors=True)
    stamp = time.strftime("%Y-%m-%d")
    b, a = versions["before"], versions["after"]
    path = HERE / "results" / f"paired-{stamp}-{b.label}-{a.label}{'-quick' * args.quick}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "args": {**vars(args), "rounds": rounds_wanted},
                "versions": {
                    v.name: {"label": v.label, "sqlease_file": v.seen, "brokers": v.brokers}
                    for v in (b, a)
                },
                "seconds": round(time.monotonic() - started),
                "metrics": rows,
                "vs_baselines": versus,
                "rounds": rounds,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"{round(time.monotonic() - started)} s; written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
