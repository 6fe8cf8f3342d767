"""A finished trainer exits 0: 2-rank torchrun trainers with CP and with EP end cleanly every time.

Once, a run whose 3 steps had all trained failed anyway: rank 1 aborted at exit ("terminate called without
an active exception": a std::thread destroyed while joinable) and torchrun reported the group failed.
One exit is a coin toss, so the trainer is ended 20 times; every end must also have ended its gloo threads
before the interpreter's own end (teardown.py warns when some still run), which fails deterministically
where the abort is only likely: before the fix 15 exits (5 a layout, 2 loaded cores) all returned 0, yet
every rank left its gloo threads to the interpreter's shutdown (12 with CP or hf EP, 6 with torchtitan EP);
after it, 15 of 15 and 0 threads. The 20 ends run in one torchrun launch (tests/trainer_ends_worker.py: the
trainer's entry point once per config, gloo threads counted after each), which then exits itself: a launch
per end paid torch's and torchtitan's imports 20 times."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

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
# rounds over the layouts: 4 x 5 = the 20 ends the issue asks for; raise it to measure a rate
RUNS = int(os.environ.get("PRIMEBUILD_TEARDOWN_RUNS", "4"))
WORKER = Path(__file__).with_name("trainer_ends_worker.py")


def end_configs(tmp_path: Path) -> list[Path]:
    """One 1-step trainer config per end, each with its own run folder holding the same step-1 batch."""
    batches = {}
    for moe in (False, True):  # one batch a model: the ends differ in layout, not in data
        model = make_tiny_model(tmp_path / f"model-{moe}", moe=moe)
        write_rollouts(tmp_path / f"batch-{moe}", model, range(1, 2), num_prompts=2, group_size=2)
        batches[moe] = model, tmp_path / f"batch-{moe}" / "rollouts"
    configs = []
    for i in range(RUNS):
        for layout, spec in LAYOUTS.items():
            model, rollouts = batches[spec["moe"]]
            run = tmp_path / f"{layout}-{i}"
            shutil.copytree(rollouts, run / "rollouts")
            cfg = tmp_path / f"{layout}-{i}.json"
            cfg.write_text(trainer_config(run_dir=str(run), model_path=str(model), max_steps=1,
                                          engine=spec["engine"], parallel=spec["parallel"]).model_dump_json())
            configs.append(cfg)
    return configs


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_finished_trainers_always_exit_zero(tmp_path):
    configs = end_configs(tmp_path)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", str(WORKER), *map(str, configs)],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=800)
    print(f"{len(configs)} ends in {time.monotonic() - t0:.1f} s")
    out = proc.stdout + proc.stderr
    # (two ranks' lines can meet on one line of torchrun's output)
    ends = re.findall(r"end \d+ (\S+) exit (-?\d+) gloo_threads (\d+)", proc.stdout)
    bad = [" ".join(e) for e in ends if e[1:] != ("0", "0")]
    # every end on both ranks, each exit 0 with no gloo thread left; then the launch itself exits 0
    assert len(ends) == 2 * len(configs) and not bad, "\n".join(bad) + "\n" + out[-4000:]
    assert proc.returncode == 0, out[-4000:]
    assert "terminate called" not in out and "gloo threads still run" not in out, out[-4000:]
    assert {e[0] for e in ends} == set(map(str, configs))


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
