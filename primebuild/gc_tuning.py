"""How primebuild's processes use CPython's cyclic garbage collector.

Importing torch, torchtitan and transformers leaves ~400k objects that live as long as the process, and the
collector walks all of them at every full collection: with the default thresholds (700, 10, 10) that was ~15%
of a trainer's start-up CPU and ~13% of the CPU of the test modules profiled (bench/RESULTS.md, "Test suite
time", round 10).
Collecting the young generation every 10k allocations instead makes full collections ~14x rarer (cyclic
garbage still goes, a little later: the main job's process tree peaked at the same RSS, 1,139 against 1,148
MiB), and freezing what start-up built keeps later collections off it.
"""

import atexit
import gc


def collect_rarely() -> None:
    """Run once, before the heavy imports: primebuild/__init__.py does, and every primebuild process
    imports it first (the CLI, and each role started as `python -m primebuild.…`)."""
    gc.set_threshold(10_000, 10, 10)


def freeze_startup() -> None:
    """After start-up: the objects alive now (modules, classes, the config) are never walked again. At exit
    they go back to the collector, so that extensions see them freed (triton's nanobind lists every object
    it finds alive at exit as a leak)."""
    gc.freeze()
    atexit.register(gc.unfreeze)
