import os
import sys

import pytest

# The repo root (for `import flatshard` without an install) and tests/ itself (for
# `from distributed import run_distributed`; tests/ is not a package) must be importable.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(_TESTS_DIR), _TESTS_DIR):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from distributed import shutdown_pools  # noqa: E402  (needs the sys.path set up above)

OPT_IN = {"exhaustive": "--exhaustive", "chaos": "--chaos"}  # marker: the option running it


def pytest_addoption(parser):
    parser.addoption(
        "--exhaustive",
        action="store_true",
        help="also run the tests marked exhaustive: the rest of the cross products that CI "
        "samples (tests/README.md)",
    )
    parser.addoption(
        "--chaos",
        action="store_true",
        help="also run the tests marked chaos: long runs with random failures (minutes)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long test (deselect with -m 'not slow')")
    config.addinivalue_line(
        "markers",
        "exhaustive: the rest of a cross product whose CI cases sample every axis; run only "
        "with --exhaustive",
    )
    config.addinivalue_line(
        "markers", "chaos: a long run with random failures; run only with --chaos"
    )


def pytest_collection_modifyitems(config, items):
    skipped = [marker for marker, option in OPT_IN.items() if not config.getoption(option)]
    left_out = [item for item in items if any(item.get_closest_marker(m) for m in skipped)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]


@pytest.fixture(scope="session", autouse=True)
def _distributed_pools():
    """Worker pools live for the whole session; stop them when it ends."""
    yield
    shutdown_pools()


# FLATSHARD_TEST_TIMES=path: each test file's summed durations (setup, call and teardown of
# its tests), test count and how busy the machine's cores were meanwhile (a file that leaves a
# core idle is waiting, not computing), written as JSON when the session ends (tests/README.md).
_FILE_TIMES: dict[str, list[float]] = {}
_FILE_TICKS: dict[str, list[int]] = {}


def _cpu_ticks() -> tuple[int, int]:
    """(busy, all) clock ticks of every core since boot; (0, 0) without /proc."""
    try:
        with open("/proc/stat") as handle:
            fields = [int(field) for field in handle.readline().split()[1:9]]
    except OSError:
        return 0, 0
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields) - idle, sum(fields)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    before = _cpu_ticks()
    yield
    after = _cpu_ticks()
    ticks = _FILE_TICKS.setdefault(item.nodeid.split("::")[0], [0, 0])
    ticks[0] += after[0] - before[0]
    ticks[1] += after[1] - before[1]


def pytest_runtest_logreport(report):
    entry = _FILE_TIMES.setdefault(report.nodeid.split("::")[0], [0.0, 0])
    entry[0] += report.duration
    entry[1] += report.when == "call"


def pytest_sessionfinish(session):
    path = os.environ.get("FLATSHARD_TEST_TIMES")
    if path:
        import json

        times = {name: {"seconds": round(s, 2), "tests": n} for name, (s, n) in _FILE_TIMES.items()}
        for name, (busy, total) in _FILE_TICKS.items():
            if total and name in times:
                times[name]["busy"] = round(busy / total, 3)
        with open(path, "w") as handle:
            json.dump(times, handle, indent=1, sort_keys=True)
