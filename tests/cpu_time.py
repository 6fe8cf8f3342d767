"""Each test's CPU seconds, in the junit report `.ci/run` writes (property `cpu_s`), for .ci/suite_time.py.

The suite keeps 2 cores ~98% busy, so its wall time is its CPU time over the cores: a test's wall time says
how long it waited (and how busy its neighbours were), its CPU time what it costs the suite. Counted: this
test process's own CPU and that of every child it reaped during the test, with their reaped descendants
(os.times: a server a test starts and then stops counts; a process orphaned to init does not, nor what
slurmd, sshd or podman run for a test: the `cluster` files cost more than their CPU column says). A session
fixture's cost falls to the test during whose setup or teardown it was built or closed.
"""

from __future__ import annotations

import os

import pytest

_started = pytest.StashKey[float]()


def _cpu_now() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_started] = _cpu_now()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    if call.when == "teardown" and _started in item.stash:
        item.user_properties.append(("cpu_s", f"{_cpu_now() - item.stash[_started]:.2f}"))
    return (yield)
