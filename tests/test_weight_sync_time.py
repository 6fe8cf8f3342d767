"""The plan's weight-sync time on CPU (timing.cpu_weight_sync_estimate): a pure function of bytes and
receivers, and the figure the plan prints. Its constants are measured by bench/weight_sync_time.py."""

from __future__ import annotations

import pytest
from conftest import MANIFESTS, call_cli, plan_json

from primebuild.builders import timing
from primebuild.builders.memory import weight_bytes
from primebuild.builders.model_facts import load_model_facts
from primebuild.builders.timing import cpu_weight_sync_estimate
from primebuild.errors import UserError

TINY_FP32 = sum(weight_bytes(load_model_facts(MANIFESTS / "models" / "reverse-text-tiny.json"), "fp32"))


@pytest.mark.parametrize("mode", ["filesystem", "broadcast"])
def test_the_estimate_is_a_pure_function_of_bytes_and_receivers(mode):
    one = cpu_weight_sync_estimate(10**8, mode=mode, receivers=1)
    assert one == cpu_weight_sync_estimate(10**8, mode=mode, receivers=1)  # nothing else goes in
    assert one.seconds == pytest.approx(one.write_seconds + one.read_seconds)
    two = cpu_weight_sync_estimate(10**8, mode=mode, receivers=2)
    bigger = cpu_weight_sync_estimate(3 * 10**8, mode=mode, receivers=1)
    assert two.write_seconds == one.write_seconds  # the sender's part does not depend on the receivers
    per_receiver = (timing.CPU_FS_LOAD_S + 10**8 / timing.CPU_FS_LOAD_BYTES_PER_S if mode == "filesystem"
                    else timing.CPU_BROADCAST_RECEIVER_S + 10**8 / timing.CPU_BROADCAST_BYTES_PER_S)
    assert two.read_seconds - one.read_seconds == pytest.approx(per_receiver)
    assert bigger.seconds > one.seconds > cpu_weight_sync_estimate(0, mode=mode, receivers=1).seconds > 0


def test_filesystem_publishes_at_page_cache_speed_then_at_the_disks():
    fixed = timing.CPU_FS_SYNC_S
    small = cpu_weight_sync_estimate(10**6, mode="filesystem", receivers=1)
    assert small.write_seconds == pytest.approx(fixed + 10**6 / timing.CPU_FS_CACHED_BYTES_PER_S)
    beyond = timing.CPU_FS_CACHED_BYTES + 10**7
    big = cpu_weight_sync_estimate(beyond, mode="filesystem", receivers=1)
    assert big.write_seconds == pytest.approx(fixed + timing.CPU_FS_CACHED_BYTES / timing.CPU_FS_CACHED_BYTES_PER_S
                                              + 10**7 / timing.CPU_FS_DISK_BYTES_PER_S)


def test_bad_arguments_are_errors():
    for kwargs in (dict(mode="nfs", receivers=1), dict(mode="filesystem", receivers=0)):
        with pytest.raises(UserError):
            cpu_weight_sync_estimate(1, **kwargs)


@pytest.mark.parametrize("manifest, sets, mode, receivers", [
    ("reverse-text.yaml", (), "filesystem", 1),  # the main job
    ("reverse-text-pd.yaml", (), "filesystem", 2),  # a prefill and a decode server both load
    ("reverse-text-slurm.yaml", ("weight_sync.mode=broadcast", "hardware.nodes=2"), "broadcast", 1),  # 2 CPU nodes
])
def test_the_plan_prints_the_estimate(capsys, manifest, sets, mode, receivers):
    expected = cpu_weight_sync_estimate(TINY_FP32, mode=mode, receivers=receivers)
    estimates = plan_json(MANIFESTS / manifest, sets)["estimates"]
    assert estimates["weight_sync"]["seconds"] == pytest.approx(expected.seconds)
    assert estimates["weight_sync"]["bytes"] == TINY_FP32
    args = [a for s in sets for a in ("--set", s)]
    result = call_cli(capsys, "plan", str(MANIFESTS / manifest), *args)
    assert result.code == 0, result.err
    line = f"weight sync ({mode}): {TINY_FP32 / 1e6:,.1f} MB per step to {receivers} server"
    assert line in result.out and f"~{expected.seconds:,.3f} s" in result.out


def test_synchronous_rl_adds_the_sync_to_the_update_handoff():
    est = plan_json(MANIFESTS / "long-tail.yaml")["estimates"]  # a CPU manifest with a rollout profile
    costs = timing.cpu_costs(load_model_facts(MANIFESTS / "models" / "reverse-text-tiny.json"), 2,
                             est["weight_sync"]["seconds"])
    assert costs.weight_sync_s == pytest.approx(timing.CPU_WEIGHT_UPDATE_HANDOFF_S + est["weight_sync"]["seconds"])


def test_the_cpu_estimate_decodes_on_the_threads_the_server_gets():
    """`inference.threads` sets the server's OMP threads (processes.py); the estimate used half the node's
    cores whatever it said, so a one-thread server on an 8-core node was estimated 4x too fast."""
    facts = load_model_facts(MANIFESTS / "models" / "reverse-text-tiny.json")
    default, one = (timing.cpu_costs(facts, 8, 0.0, inference_threads=t) for t in (None, 1))
    assert one.prefill_s_per_token == pytest.approx(4 * default.prefill_s_per_token)
    assert one.train_s(8, 64) == default.train_s(8, 64)  # the trainer's ranks keep their half
    sets = ["hardware.cpus_per_node=8"]
    est = [plan_json(MANIFESTS / "long-tail.yaml", s)["estimates"]["profile"] for s in (sets, [*sets, "inference.threads=1"])]
    assert est[1]["sync_step_seconds"] > est[0]["sync_step_seconds"]
