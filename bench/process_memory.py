"""How much memory the embedded default's process tree takes, process by process, beside its step rate.

Runs `primebuild run manifests/reverse-text.yaml` (the SFT model from the store; `--steps` RL steps) and
samples the whole tree under the `primebuild run` process every 0.2 s: resident set (RSS, what `ps`
shows, shared pages counted in every process) and proportional set (PSS, shared pages split between the
processes that map them, so the sum is what the tree really costs the machine). Prints each process's
peak, the tree's peak sums, and the RL step rate from metrics.jsonl.

    .venv/bin/python bench/process_memory.py [--steps 60] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024


def role(proc: psutil.Process) -> str:
    """A short name for a process of the run: the plan process a worker is, or its program."""
    try:
        argv = proc.cmdline()
    except psutil.Error:
        return "?"
    if "--process" in argv:
        return argv[argv.index("--process") + 1]
    for module in ("primebuild.runtime.trainer", "primebuild.runtime.inference", "primebuild.runtime.orchestrator",
                   "torch.distributed.run", "primebuild.cli"):
        if any(a.startswith(module) for a in argv):
            return module.rsplit(".", 1)[-1] + (f" (pid {proc.pid})" if module.endswith("trainer") else "")
    return Path(argv[0]).name if argv else "?"


peaks_names: dict[int, str] = {}
torch_loaded: set[str] = set()  # processes with libtorch mapped


def maps_torch(proc: psutil.Process) -> bool:
    try:
        return any("libtorch" in m.path for m in proc.memory_maps())
    except psutil.Error:
        return False


def sample(root: psutil.Process, peaks: dict, tree_peak: dict, look_at_maps: bool) -> None:
    rss_sum = pss_sum = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            info = proc.memory_full_info()
        except psutil.Error:
            continue
        name = peaks_names.setdefault(proc.pid, role(proc))  # a worker execs: keep its first plan name
        name = f"{name} [{proc.pid}]"
        if look_at_maps and name not in torch_loaded and maps_torch(proc):
            torch_loaded.add(name)
        peaks[name]["rss"] = max(peaks[name]["rss"], info.rss)
        peaks[name]["pss"] = max(peaks[name]["pss"], info.pss)
        rss_sum += info.rss
        pss_sum += info.pss
    tree_peak["rss"] = max(tree_peak["rss"], rss_sum)
    tree_peak["pss"] = max(tree_peak["pss"], pss_sum)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--manifest", default="manifests/reverse-text.yaml")
    parser.add_argument("--set", action="append", default=[], dest="sets")
    args = parser.parse_args()

    runs = Path(tempfile.mkdtemp(prefix="pb-mem-"))
    cmd = [str(Path(sys.executable).parent / "primebuild"), "run", args.manifest, "--runs-dir", str(runs), "-q",
           "--set", f"orchestrator.max_steps={args.steps}", *[x for s in args.sets for x in ("--set", s)]]
    peaks: dict = defaultdict(lambda: {"rss": 0, "pss": 0})
    tree_peak = {"rss": 0, "pss": 0}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO)
    root = psutil.Process(proc.pid)
    ticks = 0
    while proc.poll() is None:
        sample(root, peaks, tree_peak, look_at_maps=ticks % 25 == 0)  # maps every 5 s: reading them is slow
        ticks += 1
        time.sleep(0.2)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        sys.exit(f"run failed ({proc.returncode}); see {runs}")
    run_dir = next(p for p in runs.iterdir() if p.is_dir())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rate = ""
    step_s = [r["value"] for r in rows if r.get("name") == "step_s" and r["step"] > 5]  # after warm-up
    if step_s:
        rate = f"trainer {sum(step_s) / len(step_s):.2f} s per step"
    print(f"{'process':44s} {'peak RSS':>10s} {'peak PSS':>10s}  torch")
    for name, peak in sorted(peaks.items(), key=lambda kv: -kv[1]["pss"]):
        if peak["rss"] > 20 * MIB:
            torch = "yes" if name in torch_loaded else "no"
            print(f"{name:44s} {peak['rss'] / MIB:8.0f} MiB {peak['pss'] / MIB:8.0f} MiB  {torch}")
    print(f"{'tree (peak of the sums)':44s} {tree_peak['rss'] / MIB:8.0f} MiB {tree_peak['pss'] / MIB:8.0f} MiB")
    print(f"wall {wall:.1f} s for {args.steps} steps; steady rate {rate or 'n/a'}; run folder {run_dir}")


if __name__ == "__main__":
    main()
