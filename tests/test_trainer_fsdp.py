"""FSDP2 over gloo with 2 ranks (torchrun) gives the same trajectory as 1 rank, fp32."""

import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from trainer_fixtures import make_tiny_model, trainer_config, write_rollouts

from primebuild.runtime.trainer.main import run_trainer
from primebuild.runtime.trainer.metrics import read_metrics
from primebuild.runtime.weight_sync.filesystem import stable_steps, step_folder

torch.set_num_threads(2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_match_one_rank(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    # Several micro-batches per step, dealt unevenly over ranks (some ranks get padding micro-batches).
    common = dict(model_path=str(model), max_steps=3, lr=1e-3, micro_batch_tokens=48, loss="dppo-kl")
    runs = {}
    for name in ("one", "two"):
        runs[name] = tmp_path / name
        write_rollouts(runs[name], model, range(1, 5), num_prompts=5, group_size=3)

    run_trainer(trainer_config(run_dir=str(runs["one"]), **common))

    cfg = tmp_path / "two.json"
    two = trainer_config(run_dir=str(runs["two"]), checkpoint_every=3, parallel={"dp_shard": 2}, **common)
    cfg.write_text(two.model_dump_json())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
        "primebuild.runtime.trainer.main",
        "--config",
        str(cfg),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    one = read_metrics(runs["one"] / "metrics.jsonl")
    two = read_metrics(runs["two"] / "metrics.jsonl")
    assert sorted(two) == [1, 2, 3]
    for step in (1, 2, 3):
        for name in ("loss", "grad_norm", "behaviour_kl", "entropy", "tokens", "masked_fraction"):
            assert two[step][name] == pytest.approx(one[step][name], rel=1e-5, abs=1e-7), (step, name)
    assert one[3]["loss"] != one[1]["loss"]  # the trajectory moved
    w1 = load_file(step_folder(runs["one"] / "weights", 3) / "model.safetensors")
    w2 = load_file(step_folder(runs["two"] / "weights", 3) / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-6)
    # The sharded checkpoint of the 2-rank run is stable and complete (one shard file per rank).
    ckpt = runs["two"] / "checkpoints"
    assert stable_steps(ckpt) == [3]
    assert len(list(step_folder(ckpt, 3).glob("*.distcp"))) == 2

    # DCP re-shards on load: the 2-rank checkpoint resumes on 1 rank and stays on the 1-rank trajectory.
    for name in ("one", "two"):
        run_trainer(trainer_config(run_dir=str(runs[name]), resume=True, **{**common, "max_steps": 4}))
    one = read_metrics(runs["one"] / "metrics.jsonl")
    two = read_metrics(runs["two"] / "metrics.jsonl")
    assert two[4]["loss"] == pytest.approx(one[4]["loss"], rel=1e-5, abs=1e-7)
    assert two[4]["grad_norm"] == pytest.approx(one[4]["grad_norm"], rel=1e-5)
