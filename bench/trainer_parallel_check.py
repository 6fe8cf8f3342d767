"""By hand, beyond CI's 2 ranks: a parallel layout of the trainer on N gloo ranks vs one process, 5 steps,
tiny Qwen3-MoE, activation checkpointing on. Prints the relative difference of loss, grad norm and
entropy per step (the CI test, tests/test_trainer_parallel.py, checks 2-rank layouts for 20 steps).

    .venv/bin/python bench/trainer_parallel_check.py '{"dp_shard": 2, "cp": 2, "ep": 2}'   # 4 ranks
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from trainer_fixtures import make_tiny_model, trainer_config, write_rollouts  # noqa: E402

from primebuild.runtime.metrics import read_metrics  # noqa: E402
from primebuild.runtime.trainer.main import run_trainer  # noqa: E402

STEPS = 5


def main() -> int:
    parallel = json.loads(sys.argv[1])
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as root:
        model = make_tiny_model(Path(root, "model"), moe=True)
        common = dict(model_path=str(model), max_steps=STEPS, lr=3e-3, micro_batch_tokens=48, loss="dppo-kl",
                      activation_checkpointing=True)
        write_rollouts(Path(root, "one"), model, range(1, STEPS + 1), num_prompts=4, group_size=4)
        shutil.copytree(Path(root, "one", "rollouts"), Path(root, "two", "rollouts"))
        run_trainer(trainer_config(run_dir=str(Path(root, "one")), **common))
        config = Path(root, "config.json")
        config.write_text(trainer_config(run_dir=str(Path(root, "two")), parallel=parallel, **common).model_dump_json())
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ranks = parallel.get("dp_shard", 1) * parallel.get("cp", 1)
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                               f"--master_port={port}", "-m", "primebuild.runtime.trainer.main", "--config", str(config)],
                              env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
        if done.returncode:
            print(done.stderr[-3000:])
            return 1
        one, two = read_metrics(Path(root, "one", "metrics.jsonl")), read_metrics(Path(root, "two", "metrics.jsonl"))
    print(f"{parallel} on {ranks} ranks vs 1 process, relative differences:")
    for k in range(1, STEPS + 1):
        print(k, {m: f"{abs(two[k][m] - one[k][m]) / max(abs(one[k][m]), 1e-9):.1e}" for m in ("loss", "grad_norm", "entropy")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
