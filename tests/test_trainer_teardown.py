"""A finished trainer exits 0: 2-rank torchrun trainers with CP and with EP end cleanly every time.

Once, a run whose 3 steps had all trained failed anyway: rank 1 aborted at exit ("terminate called without
an active exception": a std::thread destroyed while joinable) and torchrun reported the group failed.
One exit is a coin toss, so each layout is ended several times; every exit must also have ended its gloo
threads before the interpreter's own end (teardown.py warns when some still run), which fails
deterministically where the abort is only likely: before the fix 15 exits (5 a layout, 2 loaded cores) all
returned 0, yet every rank left its gloo threads to the interpreter's shutdown (12 with CP or hf EP, 6 with
torchtitan EP); after it, 15 of 15 and 0 threads."""

import os
import subprocess
import sys
import time

import pytest
from conftest import free_port
from trainer_fixtures import make_tiny_model, trainer_config, write_rollouts

LAYOUTS = {
    "cp2-hf": dict(moe=False, engine="hf", parallel={"dp_shard": 1, "cp": 2}),
    "ep2-hf": dict(moe=True, engine="hf", parallel={"dp_shard": 2, "ep": 2}),
    "ep2-torchtitan": dict(moe=True, engine="torchtitan", parallel={"dp_shard": 2, "ep": 2}),
    # our data meshes beside torchtitan's (parallel_dims.build_meshes with cp / tp)
    "cp2-torchtitan": dict(moe=False, engine="torchtitan", parallel={"dp_shard": 1, "cp": 2}),
    "tp2-torchtitan": dict(moe=False, engine="torchtitan", parallel={"dp_shard": 1, "tp": 2}),
}
# per layout: 2 keeps the test near 5 min (a torchtitan run takes 30-45 s on 2 loaded cores); raise
# it to measure a rate
RUNS = int(os.environ.get("PRIMEBUILD_TEARDOWN_RUNS", "2"))


def end_trainer(tmp_path, name: str, spec: dict, model) -> subprocess.CompletedProcess:
    """One 1-step 2-rank trainer, from launch to torchrun's exit."""
    run = tmp_path / name
    write_rollouts(run, model, range(1, 2), num_prompts=2, group_size=2)
    cfg = tmp_path / f"{name}.json"
    cfg.write_text(trainer_config(run_dir=str(run), model_path=str(model), max_steps=1, engine=spec["engine"],
                                  parallel=spec["parallel"]).model_dump_json())
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", "-m", "primebuild.runtime.trainer.main", "--config",
                           str(cfg)], env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_finished_trainers_always_exit_zero(tmp_path):
    models = {moe: make_tiny_model(tmp_path / f"model-{moe}", moe=moe) for moe in (False, True)}
    failures, seconds = [], {}
    for i in range(RUNS):
        for layout, spec in LAYOUTS.items():
            t0 = time.monotonic()
            proc = end_trainer(tmp_path, f"{layout}-{i}", spec, models[spec["moe"]])
            seconds.setdefault(layout, []).append(time.monotonic() - t0)
            if proc.returncode != 0 or "terminate called" in proc.stderr or "gloo threads still run" in proc.stderr:
                failures.append(f"{layout} run {i}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    print({layout: f"{len(s)} runs, {sum(s) / len(s):.1f} s each" for layout, s in seconds.items()})
    assert not failures, f"{len(failures)} of {RUNS * len(LAYOUTS)} runs failed:\n" + "\n".join(failures)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_closing_joins_the_gloo_threads_a_mesh_keeps(tmp_path):
    """The cause, in one process: destroy_process_group() leaves a mesh's groups and their gloo threads alive
    (until the interpreter's end); ProcessGroups.close ends them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from primebuild.runtime.trainer.teardown import ProcessGroups, gloo_threads

    before = gloo_threads()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    groups = ProcessGroups()
    groups.track(mesh["b"])  # a slice: its root holds the groups
    dist.destroy_process_group()
    deadline = time.monotonic() + 10  # a new thread names itself a moment after it starts
    while gloo_threads() <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gloo_threads() > before  # shut down, unregistered, still running
    groups.close(finished=True, default_group=True)
    assert gloo_threads() == before
