"""CI's time budget (.ci/suite_time.py, called by .ci/run): a real pytest run's junit report, summed per
test file, and a verdict against the budget that fails CI when the suite is over it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO

SCRIPT = REPO / ".ci" / "suite_time.py"

SLOW_AND_FAST = """
import subprocess
import sys
import time
import pytest

def spin(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

@pytest.fixture(scope="module")
def costly():
    spin(0.6)  # a module fixture: charged to the first test that asks for it

def test_slow(costly):
    # a child's CPU counts once the test reaps it
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.5\\n"
                    "while time.process_time() < end: pass"], check=True)

def test_fast(costly):
    pass

class TestGrouped:
    def test_in_a_class(self):
        pass
"""


def _junit(tmp_path: Path) -> Path:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_slow_one.py").write_text(SLOW_AND_FAST)
    # waits longer than the slow file, but costs no CPU: ranked after it
    (tests / "test_sleepy_one.py").write_text("import time\n\ndef test_sleepy():\n    time.sleep(2.5)\n")
    junit = tmp_path / "junit.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "cpu_time",
                           "--rootdir", str(tmp_path), "-c", "/dev/null", f"--junitxml={junit}", "tests"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO / "tests")})
    assert done.returncode == 0, done.stdout + done.stderr
    return junit


def _verdict(junit: Path, wall: float, budget: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(junit), "--wall", str(wall), "--budget", str(budget)],
                          capture_output=True, text=True, timeout=60)


def test_files_are_ranked_by_their_tests_cpu_and_a_suite_within_budget_passes(tmp_path: Path):
    junit = _junit(tmp_path)
    within = _verdict(junit, wall=100, budget=1500)
    assert within.returncode == 0, within.stdout + within.stderr
    table = [line.split() for line in within.stdout.splitlines() if re.match(r"\s+[\d.]+\s+[\d.]+\s+\d+\s+\S+$", line)]
    assert [row[-1] for row in table] == ["tests/test_slow_one.py", "tests/test_sleepy_one.py"]
    cpu, wall, tests = float(table[0][0]), float(table[0][1]), table[0][2]
    assert 1.0 <= cpu <= wall + 0.5 and tests == "3"  # fixture + reaped child, three tests (one in a class)
    assert float(table[1][0]) < 0.5 and float(table[1][1]) >= 2.5  # the sleeper: wall time, no CPU
    assert "within its budget of 1500 s (25.0 min" in within.stdout


def test_a_suite_over_budget_fails_naming_the_budget_and_the_slowest_file(tmp_path: Path):
    over = _verdict(_junit(tmp_path), wall=1501, budget=1500)
    assert over.returncode == 1
    assert "OVER its budget of 1500 s" in over.stdout
    assert "over budget: make the slowest files cheaper (tests/test_slow_one.py" in over.stdout


def test_no_report_fails(tmp_path: Path):
    missing = _verdict(tmp_path / "absent.xml", wall=1, budget=1500)
    assert missing.returncode == 1 and "no junit report" in missing.stderr


def test_ci_states_its_budget_and_fails_when_pytest_collects_nothing():
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"budget_s=\$\{CI_PYTEST_BUDGET_S:-\d+\}", ci) and "suite_time.py" in ci
    assert '[[ $rc == 5 ]]' in ci and "--durations=25" in ci


def test_the_cpu_share_busy_during_the_suite_is_reported(tmp_path: Path):
    """From /proc/stat read when pytest started and when it ended: the share tells whether another pytest
    worker could use idle cores. A busy loop on one core in between makes the share at least that core's."""
    junit = _junit(tmp_path)
    start = tmp_path / "cpu"
    start.write_text(Path("/proc/stat").read_text().splitlines()[0])
    spin = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 2\nwhile time.time() < end: pass"])
    spin.wait(30)
    done = subprocess.run([sys.executable, str(SCRIPT), str(junit), "--wall", "100", "--budget", "1500",
                           "--cpu-start", str(start)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if "busy during pytest" in line]
    cpus, busy = re.search(r"the (\d+) CPUs were (\d+)% busy", line).groups()
    assert int(cpus) == len([ln for ln in Path("/proc/stat").read_text().splitlines() if re.match(r"cpu\d+ ", ln)])
    assert 100 // int(cpus) - 15 <= int(busy) <= 100, line  # one of the cores spun the whole time
