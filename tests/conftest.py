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


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long test (deselect with -m 'not slow')")


@pytest.fixture(scope="session", autouse=True)
def _distributed_pools():
    """Worker pools live for the whole session; stop them when it ends."""
    yield
    shutdown_pools()
