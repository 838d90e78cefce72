"""Where the suite's time goes, printed at the end of every run: per file (set-up, call, teardown) and per
fixture (how often it was set up, and for how long in all).

CI has a time budget, and most of it is set-up repeated per test rather than assertions; these two tables
say which file and which fixture to look at. Under pytest-xdist each worker times its own fixtures and the
numbers travel on the reports' `user_properties`, so the controller sums the whole run.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Generator
from typing import Any

import pytest

_KEY = "ortune_fixture_seconds"
# fixtures timed on this process since its last report: (name, scope) -> [count, seconds]
_pending: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
_files: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
_fixtures: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Generator[None, None, None]:
    t0 = time.perf_counter()
    yield
    entry = _pending[(fixturedef.argname, fixturedef.scope)]
    entry[0] += 1
    entry[1] += time.perf_counter() - t0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if _pending:
        report.user_properties.append((_KEY, [[n, s, c, t] for (n, s), (c, t) in _pending.items()]))
        _pending.clear()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    test_file = report.nodeid.split("::", 1)[0]
    _files[test_file][report.when] += report.duration
    if report.when == "call":
        _files[test_file]["tests"] += 1
    for key, value in report.user_properties:
        if key == _KEY:
            for name, scope, count, seconds in value:
                entry = _fixtures[(name, scope)]
                entry[0] += count
                entry[1] += seconds


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _files:
        return
    write = terminalreporter.write_line
    terminalreporter.section("time per file (seconds, summed over workers)")
    write(f"{'file':<52} {'tests':>5} {'setup':>8} {'call':>8} {'teardown':>8} {'total':>8}")
    rows = sorted(_files.items(), key=lambda kv: -sum(v for k, v in kv[1].items() if k != "tests"))
    for name, t in rows:
        total = t["setup"] + t["call"] + t["teardown"]
        write(
            f"{name:<52} {int(t['tests']):>5} {t['setup']:>8.1f} {t['call']:>8.1f} {t['teardown']:>8.1f} "
            f"{total:>8.1f}"
        )
    setup = sum(t["setup"] for t in _files.values())
    call = sum(t["call"] for t in _files.values())
    teardown = sum(t["teardown"] for t in _files.values())
    write(f"{'all':<52} {'':>5} {setup:>8.1f} {call:>8.1f} {teardown:>8.1f} {setup + call + teardown:>8.1f}")
    terminalreporter.section("time per fixture set-up (the 25 costliest)")
    write(f"{'fixture':<40} {'scope':<9} {'set-ups':>7} {'seconds':>8} {'each':>7}")
    for (name, scope), (count, seconds) in sorted(_fixtures.items(), key=lambda kv: -kv[1][1])[:25]:
        write(f"{name:<40} {scope:<9} {int(count):>7} {seconds:>8.1f} {seconds / max(count, 1):>7.2f}")
