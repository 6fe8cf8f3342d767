"""Weight broadcast between real processes over gloo on 127.0.0.1."""

import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import free_port, reap

from primebuild.runtime.weight_sync.broadcast import BroadcastReceiver, BroadcastSender
from primebuild.runtime.weight_sync.buckets import ALIGN, bucket_counts, messages, offsets
from primebuild.runtime.weight_sync.stream import TensorSpec


def make_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "embed.weight": torch.randn(300, 64, generator=g),  # 76.8 kB: a bucket of its own
        "layer.norm": torch.randn(64, generator=g).to(torch.bfloat16),
        "layer.scale": torch.tensor(float(step)),  # 0-dim
        "layer.count": torch.arange(5, dtype=torch.int64) * step,
        "layer.t": torch.randn(8, 4, generator=g).t(),  # non-contiguous view
        # 6 kB each: a bucket apiece, so later buckets could land in earlier buckets' buffers
        **{f"model.layers.{i}.w": torch.randn(1536, generator=g) for i in range(4)},
    }


def sender_main(init_method, world_size, steps):
    torch.set_num_threads(1)
    sender = BroadcastSender(init_method, world_size, timeout_s=60, bucket_mb=0.01)  # ~10 kB buckets
    for step in steps:
        sender.send(make_state(step), step)
    sender.close()


def receiver_main(init_method, world_size, rank, queue):
    torch.set_num_threads(1)
    receiver = BroadcastReceiver(init_method, world_size, rank, timeout_s=60)
    got = []
    while (update := receiver.recv()) is not None:
        got.append(update)
    try:  # checked here: tensors put on a queue would die with this process
        check(got, [7])
        queue.put("ok")
    except AssertionError as e:
        queue.put(f"rank {rank}: {e!r}")


def check(updates, steps):
    assert [s for s, _ in updates] == steps
    for step, state in updates:
        want = make_state(step)
        assert list(state) == list(want)
        for k in want:
            assert state[k].dtype == want[k].dtype and state[k].shape == want[k].shape
            assert torch.equal(state[k], want[k]), k


def specs(sizes: dict[str, int]) -> list[TensorSpec]:
    """Tensors of `ALIGN` x n bytes each (uint8), so sizes count in alignment units."""
    return [TensorSpec(name, torch.uint8, (n * ALIGN,)) for name, n in sizes.items()]


def test_buckets_keep_layers_whole_cut_big_layers_between_tensors_and_never_split_a_tensor():
    layout = specs({"embed": 5, "model.layers.0.q": 2, "model.layers.0.k": 2, "model.layers.1.q": 2,
                    "model.layers.1.k": 2, "model.layers.2.big": 9, "model.layers.2.small": 1,
                    "model.layers.3.a": 3, "model.layers.3.b": 3, "model.layers.3.c": 3, "norm": 1})
    # 8 units a bucket: layer 0 does not fit beside the embedding, layers 0 and 1 share one, the 9-unit
    # tensor is a bucket of its own, layer 3 (9 units) is cut between its tensors
    assert bucket_counts(layout, 8 * ALIGN) == [1, 4, 1, 1, 2, 1, 1]
    assert bucket_counts(layout, 100 * ALIGN) == [len(layout)]
    assert sum(bucket_counts(layout, 1)) == len(layout)  # tiny buckets: one tensor each


def test_a_bucket_crosses_as_its_big_tensors_and_the_packed_runs_between_them():
    layout = [TensorSpec("norm_a", torch.uint8, (10,)), TensorSpec("bias", torch.uint8, (70,)),
              TensorSpec("big", torch.uint8, (1000,)), TensorSpec("big2", torch.uint8, (999,)),
              TensorSpec("norm_b", torch.uint8, (5,))]
    where, size = offsets(layout)
    # big tensors (>= 999 bytes here) go alone, their padding unsent; small neighbours travel as one
    assert messages(layout, direct_bytes=999) == [(0, 2, 0, where[2], False), (2, 3, where[2], where[2] + 1000, True),
                                                  (3, 4, where[3], where[3] + 999, True), (4, 5, where[4], size, False)]
    assert messages(layout, direct_bytes=10**6) == [(0, 5, 0, size, False)]  # all small: one packed message
    assert messages([]) == []


@pytest.mark.timeout(60)
def test_sender_to_one_receiver_two_updates_then_close():
    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=sender_main, args=(init, 2, [1, 2]))
    proc.start()
    try:
        receiver = BroadcastReceiver(init, 2, 1, timeout_s=60)
        updates = []
        # a loader that keeps the buckets' own views, as vLLM's layerwise reload does until a module is
        # complete: the receiver must not refill a buffer still seen through them
        while (announced := receiver.announcement()) is not None:
            state = {}
            receiver.pull(announced, state.update)
            updates.append((announced.step, state))
    finally:
        proc.join(30)
    assert proc.exitcode == 0
    check(updates, [1, 2])


@pytest.mark.timeout(60)
def test_sender_to_two_receivers():
    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=receiver_main, args=(init, 3, r, queue)) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        sender_main(init, 3, [7])
        results = [queue.get(timeout=30) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
    assert all(p.exitcode == 0 for p in procs)
    assert results == ["ok", "ok"]


def announced_only(init_method, world_size, rank, queue):
    """A receiver whose server never updates: it hears the step announced and never asks for it."""
    receiver = BroadcastReceiver(init_method, world_size, rank, timeout_s=60)
    queue.put(receiver.announcement().step)
    time.sleep(60)


@pytest.mark.timeout(60)
def test_a_stopped_run_abandons_an_update_nobody_asks_for():
    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=announced_only, args=(init, 2, 1, queue), daemon=True)
    proc.start()
    try:
        sender = BroadcastSender(init, 2, timeout_s=60)
        stop_at = time.monotonic() + 1.0
        assert sender.send(make_state(3), 3, cancelled=lambda: time.monotonic() > stop_at) is None
        assert queue.get(timeout=10) == 3 and time.monotonic() - stop_at < 5
        sender.close()  # returns at once: the receiver is not listening for a close
        with pytest.raises(RuntimeError, match="abandoned"):
            sender.send(make_state(4), 4)
    finally:
        proc.kill()
        proc.join(10)


def churn_sender(init_method, steps_before, steps_after, admitted, queue):
    """Sends `steps_before`, waits until the test says a restarted receiver registered, sends the rest."""
    torch.set_num_threads(1)
    sender = BroadcastSender(init_method, 3, timeout_s=60, bucket_mb=0.01, delta=True)
    generations = []
    for step in steps_before:
        sender.send(make_state(step), step)
        generations.append((step, sender.generation, sorted(sender.members)))
    admitted.wait(60)
    for step in steps_after:
        sender.send(make_state(step), step)
        generations.append((step, sender.generation, sorted(sender.members)))
    sender.close()
    queue.put(("sender", generations))


def steady_receiver(init_method, rank, queue):
    """Takes every update it is announced; reports the steps, checked against what was sent."""
    torch.set_num_threads(1)
    receiver = BroadcastReceiver(init_method, 3, rank, timeout_s=60)
    queue.put((f"registered {rank}", receiver.incarnation))
    got = []
    while (update := receiver.recv()) is not None:
        got.append(update)
        queue.put((f"rank {rank} has", update[0]))
    check(got, [s for s, _ in got])
    queue.put((f"rank {rank}", [s for s, _ in got]))


def stalling_receiver(init_method, rank, queue):
    """Takes the first update, then hangs before the next one (the test kills it -9 there)."""
    torch.set_num_threads(1)
    receiver = BroadcastReceiver(init_method, 3, rank, timeout_s=60)
    step, state = receiver.recv()
    check([(step, state)], [step])
    queue.put(("stalled after", step))
    receiver.announcement()
    time.sleep(600)


class Inbox:
    """Messages of several processes on one queue, taken by tag in the order each process sent them."""

    def __init__(self, queue):
        self.queue, self.kept = queue, []

    def next(self, tag, timeout=90):
        for i, (got_tag, value) in enumerate(self.kept):
            if got_tag == tag:
                del self.kept[i]
                return value
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got_tag, value = self.queue.get(timeout=max(0.1, deadline - time.monotonic()))
            if got_tag == tag:
                return value
            self.kept.append((got_tag, value))
        raise AssertionError(f"no {tag!r} within {timeout} s")


@pytest.mark.timeout(180)
def test_a_receiver_killed_mid_run_is_left_out_and_its_restart_rejoins_at_the_next_update():
    """Membership (membership.py): rank 2 dies -9 while the sender waits for it to ask for step 2; step 2
    is announced again to a generation without it and reaches rank 1. A new process on rank 2 registers
    and is admitted at step 3, in full although the sender sends deltas, and both take steps 3 and 4."""
    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    queue, victim_queue, admitted = ctx.Queue(), ctx.Queue(), ctx.Event()  # a killed writer may spoil a queue
    sender = ctx.Process(target=churn_sender, args=(init, [1, 2], [3, 4], admitted, queue))
    steady = ctx.Process(target=steady_receiver, args=(init, 1, queue))
    victim = ctx.Process(target=stalling_receiver, args=(init, 2, victim_queue))
    procs, inbox = [sender, steady, victim], Inbox(queue)
    for p in procs:
        p.start()
    try:
        assert Inbox(victim_queue).next("stalled after") == 1
        os.kill(victim.pid, 9)
        assert inbox.next("rank 1 has") == 1
        assert inbox.next("rank 1 has") == 2  # without waiting for the dead rank 2 (beyond its silence)
        restarted = ctx.Process(target=steady_receiver, args=(init, 2, queue))
        restarted.start()
        procs.append(restarted)
        inbox.next("registered 2")
        admitted.set()
        results = {tag: inbox.next(tag) for tag in ("rank 1", "rank 2", "sender")}
    finally:
        reap(procs)
    assert results["rank 1"] == [1, 2, 3, 4]
    assert results["rank 2"] == [3, 4]  # the restarted one: from its admission on, whole weights first
    # generation 1: both; 2: rank 1 alone (step 2 again); 3: rank 1 and the restarted rank 2
    assert results["sender"] == [(1, 1, [1, 2]), (2, 2, [1]), (3, 3, [1, 2]), (4, 3, [1, 2])]
    assert sender.exitcode == 0 and steady.exitcode == 0 and restarted.exitcode == 0


def scaling_sender(init_method, admitted, left, queue):
    """The plan has one receiver (world size 2); a third process joins beyond it, takes two updates, leaves."""
    torch.set_num_threads(1)
    sender = BroadcastSender(init_method, 2, timeout_s=60, bucket_mb=0.01)
    generations = []

    def send(step):
        sender.send(make_state(step), step)
        generations.append((step, sender.generation, sorted(sender.members)))

    send(1)
    admitted.wait(60)
    send(2)
    send(3)
    left.wait(60)
    started = time.monotonic()
    send(4)
    sender.close()
    queue.put(("sender", (generations, time.monotonic() - started)))


def taking_receiver(init_method, world_size, rank, queue, updates=None):
    """Takes every update it is announced (or `updates` of them, then leaves the group for good)."""
    torch.set_num_threads(1)
    receiver = BroadcastReceiver(init_method, world_size, rank, timeout_s=60)
    queue.put((f"registered {rank}", receiver.incarnation))
    got = []
    while (updates is None or len(got) < updates) and (update := receiver.recv()) is not None:
        got.append(update)
        queue.put((f"rank {rank} has", update[0]))
    if updates is not None:
        receiver.leave()
    check(got, [s for s, _ in got])
    queue.put((f"rank {rank}", [s for s, _ in got]))


@pytest.mark.timeout(180)
def test_a_rank_beyond_the_plans_is_admitted_at_the_next_update_and_leaves_without_a_wait():
    """`primebuild scale` under broadcast (membership.py): a receiver with a rank the sender was not planned
    with lists itself, is admitted at the next update (in full), and once it leaves for good the next update
    goes to the plan's receiver alone at once, not after its beat has been silent for DEAD_AFTER_S."""
    from primebuild.runtime.weight_sync.membership import DEAD_AFTER_S

    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    queue, admitted, left = ctx.Queue(), ctx.Event(), ctx.Event()
    sender = ctx.Process(target=scaling_sender, args=(init, admitted, left, queue))
    planned = ctx.Process(target=taking_receiver, args=(init, 2, 1, queue))
    procs, inbox = [sender, planned], Inbox(queue)
    for p in procs:
        p.start()
    try:
        assert inbox.next("rank 1 has") == 1
        added = ctx.Process(target=taking_receiver, args=(init, 2, 2, queue, 2))
        added.start()
        procs.append(added)
        inbox.next("registered 2")
        admitted.set()
        assert inbox.next("rank 2") == [2, 3]
        added.join(30)
        left.set()
        results = {tag: inbox.next(tag) for tag in ("rank 1", "sender")}
    finally:
        reap(procs)
    assert results["rank 1"] == [1, 2, 3, 4]
    generations, last_send_s = results["sender"]
    # generation 1: the plan's rank; 2: with the added rank 2; 3: without it, formed at once
    assert generations == [(1, 1, [1]), (2, 2, [1, 2]), (3, 2, [1, 2]), (4, 3, [1])]
    assert last_send_s < DEAD_AFTER_S, last_send_s
    assert sender.exitcode == 0 and planned.exitcode == 0 and added.exitcode == 0


def torchrun_trainer(cfg, tmp_path) -> subprocess.Popen:
    path = tmp_path / "trainer.json"
    path.write_text(cfg.model_dump_json())
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run",
                             f"--nproc_per_node={cfg.parallel.world_size}", f"--master_port={free_port()}", "-m",
                             "primebuild.runtime.trainer.main", "--config", str(path)],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("parallel", "fp8"), [({}, False), ({"dp_replicate": 2}, False), ({}, True)],
                         ids=["one-rank", "hsdp-2-replicas", "one-rank-fp8-wire"])
def test_trainer_broadcasts_each_step(parallel, fp8, tmp_path):
    """Rank 0 sends; with HSDP replicas the other rank gathers with it and sends nothing. For FP8 servers
    (fp8_served_dtype) the matmul weights cross as the blocks the server would have computed."""
    from trainer_fixtures import make_tiny_model, trainer_config, write_rollouts
    from transformers import AutoModelForCausalLM

    from primebuild.runtime.trainer.checkpoint import load_checkpoint
    from primebuild.runtime.trainer.model import Policy
    from primebuild.runtime.weight_sync.filesystem import latest_stable

    model_path = make_tiny_model(tmp_path / "model")
    run = tmp_path / "run"
    write_rollouts(run, model_path, range(1, 3), num_prompts=2)
    init = f"tcp://127.0.0.1:{free_port()}"
    cfg = trainer_config(model_path=str(model_path), run_dir=str(run), max_steps=2, lr=1e-3,
                         weight_sync={"mode": "broadcast", "init_method": init, "world_size": 2, "timeout_s": 60,
                                      "fp8_served_dtype": "float32" if fp8 else None},
                         parallel=parallel)
    proc = torchrun_trainer(cfg, tmp_path)
    try:
        receiver = BroadcastReceiver(init, 2, 1, timeout_s=120)
        updates = []
        while (u := receiver.recv()) is not None:
            updates.append(u)
    finally:
        output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output[-3000:]
    assert [s for s, _ in updates] == [1, 2]
    assert not (run / "weights").exists()  # broadcast mode writes no weight folders

    # The last update equals the trainer's final parameters (restored from its checkpoint), in HF naming.
    model = Policy(AutoModelForCausalLM.from_pretrained(model_path), chunk_tokens=64)
    load_checkpoint(latest_stable(run / "checkpoints")[1], model, torch.optim.AdamW(model.parameters()))
    sent = updates[-1][1]
    expected = model.hf.state_dict()
    if fp8:
        from primebuild.runtime.weight_sync.fp8_wire import quantise, quantised, scale_name

        blocks = {k: quantise(k, v.to(torch.float32)) for k, v in expected.items() if quantised(k)}
        assert blocks and all(sent.pop(scale_name(k)).equal(s) for k, (_, s) in blocks.items())
        for k, (q, _) in blocks.items():
            assert sent[k].view(torch.uint8).equal(q.view(torch.uint8)), k
            sent[k] = expected[k]  # checked above, in its FP8 form
    assert set(sent) == set(expected)  # the tied head travels under its own name too (model.py says why)
    for k, v in sent.items():
        assert torch.equal(v, expected[k]), k


def restarting_sender(init_method, steps, hang_on, queue):
    """A trainer's rank 0, as `WeightPublisher` drives it (delta on): says which step the servers hold,
    sends `steps`, then announces `hang_on` (if any) and waits for it until killed."""
    torch.set_num_threads(1)
    sender = BroadcastSender(init_method, 2, timeout_s=60, bucket_mb=0.01, delta=True)
    queue.put(("holds", sender.servers_hold))
    for step in steps:
        stats = sender.send(make_state(step), step)
        queue.put(("sent", (step, sender.generation, stats.encodings)))
    if hang_on is not None:
        sender.send(make_state(hang_on), hang_on)  # the server never asks for it: killed while waiting
    sender.close()


@pytest.mark.timeout(180)
def test_a_killed_sender_is_replaced_on_the_same_port_and_the_server_keeps_its_loaded_step():
    """A trainer-only restart under broadcast, at the weight-sync level: the sender dies -9 with step 3
    announced and not loaded. The server's stage drops it (a load of it ends at once: BroadcastInterrupted,
    the 409 the orchestrator does not count) and keeps step 2; a new sender on the same port learns the
    server holds step 2, and its first update reaches the rejoined server in full although delta is on."""
    from primebuild.runtime.inference.weight_receiver import BroadcastInterrupted, BroadcastStage

    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    inbox = Inbox(queue)
    first = ctx.Process(target=restarting_sender, args=(init, [1, 2], 3, queue))
    first.start()
    stage = BroadcastStage(init, rank=1, world_size=2, timeout_s=60)
    loaded: dict[str, torch.Tensor] = {}

    def load(step: int) -> int:
        return stage.pull(stage.announced(step), lambda bucket: loaded.update((k, v.clone()) for k, v in bucket))

    def until(condition, what, timeout=60):
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    second = None
    try:
        assert inbox.next("holds") == 0  # a fresh start
        for step in (1, 2):
            until(lambda s=step: stage.received_version >= s, f"step {step} announced")
            assert load(step) == step
        until(lambda: stage.received_version == 3, "step 3 announced")
        os.kill(first.pid, 9)
        first.join(10)
        with pytest.raises(BroadcastInterrupted, match="keeps step 2"):
            until(lambda: stage.lost, "the sender's loss noticed")
            load(3)
        assert stage.received_version == 2 and stage.loaded_version == 2 and stage.error is None
        check([(2, loaded)], [2])  # the served weights are step 2's, whole

        second = ctx.Process(target=restarting_sender, args=(init, [3, 4], None, queue))
        second.start()
        assert inbox.next("holds") == 2  # told by the rejoined server as it registered
        for step in (3, 4):
            until(lambda s=step: stage.received_version >= s, f"step {step} announced by the new sender")
            assert load(step) == step
            check([(step, loaded)], [step])
        sent = [inbox.next("sent") for _ in range(4)]
        until(lambda: stage.closed, "the new sender's close seen")
    finally:
        reap(p for p in (first, second) if p is not None)
    assert [s[:2] for s in sent] == [(1, 1), (2, 1), (3, 1), (4, 1)]  # the new sender's generations start at 1
    assert set(sent[2][2]) == {"full"}, sent[2]  # delta restarts: the first update after the restart is whole
    assert stage.error is None and second.exitcode == 0
