"""Cold wall time of `primebuild plan` and `primebuild validate` as whole processes.

Each run is a fresh interpreter started the way a person starts it (the `primebuild` console script
of the running interpreter's environment), timed from spawn to exit; the median of `--repeats` runs is
reported, with the bare interpreter start (`python -c pass`) beside it so the split between Python's
own start-up and primebuild's work is visible. One untimed run first warms the OS file cache, which is
what "cold" means for a command a person reruns: a fresh process, not a cold disk.

    .venv/bin/python bench/plan.py [--repeats 5] [--manifest manifests/glm5.yaml]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOAL_S = 0.5


def primebuild_command() -> list[str]:
    script = Path(sys.executable).parent / "primebuild"
    return [str(script)] if script.exists() else [sys.executable, "-m", "primebuild.cli"]


def wall_times(argv: list[str], repeats: int) -> list[float]:
    subprocess.run(argv, cwd=REPO, capture_output=True, check=False)  # warm the file cache
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, check=False)
        times.append(time.perf_counter() - start)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr.decode()}")
    return times


def in_process_compile_ms(manifest: Path, repeats: int) -> float:
    """The compiler alone (modules already imported): what is left once start-up is paid."""
    from primebuild.builders.plan import compile_plan, render_json
    from primebuild.manifest.load import load_manifest

    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        render_json(compile_plan(load_manifest(manifest)))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--manifest", default="manifests/glm5.yaml")
    args = parser.parse_args()

    pb = primebuild_command()
    rows = [
        ("python -c pass (interpreter start)", [sys.executable, "-c", "pass"]),
        (f"primebuild validate {args.manifest}", [*pb, "validate", args.manifest]),
        (f"primebuild plan {args.manifest} -o json", [*pb, "plan", args.manifest, "-o", "json"]),
        (f"primebuild plan {args.manifest} (text)", [*pb, "plan", args.manifest]),
    ]
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, median of {args.repeats} runs\n")
    print(f"| {'command':<55} | median s | min s | max s |")
    print(f"|{'-' * 57}|---------:|------:|------:|")
    medians = {}
    for label, argv in rows:
        times = wall_times(argv, args.repeats)
        medians[label] = statistics.median(times)
        print(f"| {label:<55} | {medians[label]:8.3f} | {min(times):5.3f} | {max(times):5.3f} |")
    compile_ms = in_process_compile_ms(REPO / args.manifest, args.repeats)
    print(f"\nin-process load_manifest + compile_plan + render_json (warm): {compile_ms:.1f} ms")
    plan_json = medians[rows[2][0]]
    verdict = "meets" if plan_json < GOAL_S else "misses"
    print(f"plan -o json: {plan_json:.3f} s median, {verdict} the {GOAL_S} s goal")


if __name__ == "__main__":
    main()
