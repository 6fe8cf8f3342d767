"""One rank of tests/test_trainer_teardown.py's loop: the trainer's entry point, run to its end once per config,
all in one process under one torchrun launch (a launch imports torch, transformers and torchtitan: most of a
1-step trainer's time on 2 cores).

    torchrun --nproc_per_node=2 tests/trainer_ends_worker.py CONFIG.json [CONFIG.json ...]

Each end must return 0 and leave no gloo thread running (teardown.py ends them while the interpreter is
whole; one left over is what aborted a rank at exit, and it is there deterministically where the abort is
only likely). One line a config: `end <i> <config> exit <code> gloo_threads <n>`; exit 1 if any end failed.

Each end joins a default group of its own, through a file store beside its config: a second
init_process_group on torchrun's store met the first one's keys and hung. The trainer finds the group made
(init_distributed) and ends it as always (teardown.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

from primebuild.runtime.trainer.main import main
from primebuild.runtime.trainer.teardown import gloo_threads


def end_all(configs: list[str]) -> int:
    failed = 0
    for i, config in enumerate(configs):
        store = Path(config).with_suffix(".store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
        code = main(["--config", config])
        left = gloo_threads()
        print(f"end {i} {config} exit {code} gloo_threads {left}", flush=True)
        failed += code != 0 or left != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(end_all(sys.argv[1:]))
