"""The suite's time against its budget: where the time went (per test file, from pytest's junit XML)
and whether the whole pytest run fit. `.ci/run` calls it after pytest; standard library only.

    python .ci/suite_time.py JUNIT_XML --wall SECONDS --budget SECONDS [--cpu-start FILE]

A file's time is the sum of its tests' setup + call + teardown, so a session fixture (the short SFT,
the shared vLLM server) is charged to the first file that asks for it. Its CPU seconds (tests/cpu_time.py) say
what it costs the suite: the suite keeps the cores busy, so the files are listed by CPU. Under `pytest -n N` tests run side by
side: the files' times then add up to more than the wall time, which is what the budget holds. Exit 1 when the wall time is
over the budget (naming the budget and the slowest files), else 0.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

SHOWN = 10  # files in the table


def file_of(classname: str) -> str:
    """junit's classname ("tests.test_x" or "tests.test_x.TestClass") as the file's path."""
    parts = classname.split(".")
    for i, part in enumerate(parts):
        if part.startswith("test_"):
            return "/".join(parts[: i + 1]) + ".py"
    return classname or "?"


def seconds_per_file(junit: Path) -> dict[str, tuple[float, float, int]]:
    """(wall seconds, CPU seconds, tests) per test file."""
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0.0, 0])
    for case in ET.parse(junit).getroot().iter("testcase"):
        entry = totals[file_of(case.get("classname", ""))]
        entry[0] += float(case.get("time") or 0.0)
        entry[1] += sum(float(p.get("value") or 0.0) for p in case.iter("property") if p.get("name") == "cpu_s")
        entry[2] += 1
    return {name: (t, cpu, n) for name, (t, cpu, n) in totals.items()}


def cpu_busy(start_line: str, end_line: str) -> tuple[float, int]:
    """The share of the machine's CPU time that was busy between two readings of /proc/stat's "cpu" line,
    and the number of CPUs: near 1.0, more pytest workers would only slow each test; well below, tests wait
    (servers starting, timeouts) and another worker could use the idle cores."""
    start, end = ([int(x) for x in line.split()[1:]] for line in (start_line, end_line))
    delta = [b - a for a, b in zip(start, end, strict=True)]  # the same kernel: the same fields
    idle = delta[3] + delta[4]  # idle + iowait
    cpus = sum(1 for line in Path("/proc/stat").read_text().splitlines() if re.match(r"cpu\d+ ", line))
    return 1 - idle / max(sum(delta), 1), cpus


def report(files: dict[str, tuple[float, float, int]], wall: float, budget: float) -> tuple[str, bool]:
    costliest = sorted(files.items(), key=lambda kv: (-kv[1][1], -kv[1][0]))[:SHOWN]
    lines = [f"ci: costliest test files (setup + call + teardown; of {len(files)} files, "
             f"{sum(n for *_, n in files.values())} tests):", "     CPU s   wall s  tests"]
    lines += [f"  {cpu:8.1f} {t:8.1f}  {n:5d}  {name}" for name, (t, cpu, n) in costliest]
    summed = sum(t for t, _, _ in files.values())
    cpu_summed = sum(cpu for _, cpu, _ in files.values())
    lines.append(f"ci: the tests' own times add up to {summed:.0f} s, {summed / max(wall, 1):.1f}x the wall time "
                 "(above 1: tests ran side by side, pytest -n)")
    lines.append(f"ci: the tests' CPU adds up to {cpu_summed:.0f} s, {cpu_summed / max(wall, 1):.1f} cores over "
                 "the wall time (what they and the children they reaped used)")
    over = wall > budget
    verdict = "OVER" if over else "within"
    lines.append(f"ci: pytest wall time {wall:.0f} s ({wall / 60:.1f} min), {verdict} its budget of "
                 f"{budget:.0f} s ({budget / 60:.1f} min; .ci/run states it)")
    if over:
        names = ", ".join(f"{name} ({cpu:.0f} CPU s)" for name, (_, cpu, _) in costliest[:3])
        lines.append(f"ci: the suite is over budget: make the slowest files cheaper ({names}) -- share their "
                     "servers and models across tests, run fewer steps -- rather than raise the budget")
    return "\n".join(lines), over


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--wall", type=float, required=True, help="pytest's wall time in seconds")
    parser.add_argument("--budget", type=float, required=True, help="the most seconds pytest may take")
    parser.add_argument("--cpu-start", type=Path, help="/proc/stat's first line, saved when pytest started")
    args = parser.parse_args(argv)
    if not args.junit.is_file():
        print(f"ci: no junit report at {args.junit}: pytest did not run to its end", file=sys.stderr)
        return 1
    text, over = report(seconds_per_file(args.junit), args.wall, args.budget)
    print(text)
    if args.cpu_start and args.cpu_start.is_file():
        busy, cpus = cpu_busy(args.cpu_start.read_text(), Path("/proc/stat").read_text().splitlines()[0])
        print(f"ci: the {cpus} CPUs were {busy:.0%} busy during pytest")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
