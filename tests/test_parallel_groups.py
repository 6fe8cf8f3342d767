"""`pytest -n N` (tests/parallel_groups.py): a real xdist run over a small suite puts every module with a
`vllm` test on one worker, every `cluster` module on one worker, and each other module's tests together;
and the workers draw free ports from disjoint slices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import conftest
import pytest
from parallel_groups import GROUPS_FILE

pytest.importorskip("xdist")

TESTS = Path(__file__).resolve().parent


def _clean_env(**extra: str) -> dict:
    """This process's environment less what an outer `pytest -n` gave it (its worker name, its groups file)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST") and k != GROUPS_FILE}
    return {**env, **extra}

RECORD = """\
import json, os, pathlib, time
def record(name):
    time.sleep(0.05)  # long enough that an idle worker would take the next test if it were free to
    with open(os.environ["GROUPS_OUT"], "a") as out:
        out.write(json.dumps([name, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
"""


def _module(marks: str, name: str, tests: int) -> str:
    body = "import pytest\nfrom record import record\n" + (f"pytestmark = {marks}\n" if marks else "")
    return body + "".join(f"def test_{i}():\n    record('{name}')\n" for i in range(tests))


def test_a_parallel_run_keeps_each_group_on_one_worker(tmp_path: Path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
                                       "from parallel_groups import pytest_collection_modifyitems, pytest_configure\n")
    (suite / "record.py").write_text(RECORD)
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n  vllm: x\n  cluster: x\n")
    modules = {"test_a_vllm.py": ("pytest.mark.vllm", "vllm", 4), "test_b_vllm.py": ("", "vllm", 3),
               "test_c_plain.py": ("", "plain-c", 6), "test_d_plain.py": ("", "plain-d", 6),
               "test_e_cluster.py": ("pytest.mark.cluster", "cluster", 3),
               "test_f_named.py": ("pytest.mark.xdist_group('shared')", "shared", 2),
               "test_g_named.py": ("pytest.mark.xdist_group('shared')", "shared", 2)}
    for file, (marks, name, tests) in modules.items():
        (suite / file).write_text(_module(marks, name, tests))
    (suite / "test_b_vllm.py").write_text(  # one marked test is enough to put the whole module in the group
        "import pytest\nfrom record import record\n@pytest.mark.vllm\ndef test_marked():\n    record('vllm')\n"
        + "".join(f"def test_{i}():\n    record('vllm')\n" for i in range(2)))
    out = tmp_path / "ran.jsonl"
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "3", "-p", "no:cacheprovider", "-q", str(suite)],
                          cwd=suite, capture_output=True, text=True, timeout=300,
                          env=_clean_env(GROUPS_OUT=str(out)))
    assert done.returncode == 0, done.stdout + done.stderr
    workers = defaultdict(set)
    ran = [json.loads(line) for line in out.read_text().splitlines()]
    for name, worker in ran:
        workers[name].add(worker)
    assert len(ran) == sum(tests for _, _, tests in modules.values())
    assert {name: len(w) for name, w in workers.items()} == dict.fromkeys(workers, 1), dict(workers)
    assert len(set().union(*workers.values())) > 1  # and still in parallel


def test_alone_the_hooks_keep_pytests_order(tmp_path: Path):
    (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
                                          "from parallel_groups import pytest_collection_modifyitems, pytest_configure\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  vllm: x\n")
    (tmp_path / "test_a.py").write_text("def test_a():\n    pass\n")
    (tmp_path / "test_b.py").write_text("import pytest\n@pytest.mark.vllm\ndef test_b():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_clean_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.index("test_a.py::test_a") < done.stdout.index("test_b.py::test_b")  # vllm not moved first


def test_workers_draw_ports_from_disjoint_slices(monkeypatch):
    spans = []
    for worker in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
        low, high = conftest._worker_span()
        spans.append((low, high))
        for base in [conftest.free_port(), conftest.free_port(), *conftest.free_ports(3)]:
            assert low <= base and base + max(conftest._DERIVED) < high  # each base's whole neighbourhood
        first, second, third = conftest.free_ports(3)  # side by side: neighbourhoods apart
        assert second - first > max(conftest._DERIVED) and third - second > max(conftest._DERIVED)
        a, b = conftest.free_port(), conftest.free_port()  # drawn one after the other: apart too
        assert abs(a - b) > max(conftest._DERIVED)
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(2)) and spans[0][0] == 10000, spans
    assert spans[-1][1] < conftest._ephemeral_floor()
