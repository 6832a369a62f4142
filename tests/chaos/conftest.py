"""Every test here breaks a real job (``make chaos``; ``make test`` leaves them out: they take
minutes)."""

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/chaos/" in str(item.fspath):
            item.add_marker(pytest.mark.chaos)
