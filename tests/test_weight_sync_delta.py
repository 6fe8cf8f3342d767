"""Delta weight sync (primebuild/runtime/weight_sync/delta.py): only changed elements travel, and the
receiver's weights are the sender's bit for bit after every sync."""

import multiprocessing as mp

import pytest
import torch
from conftest import free_port

from primebuild.runtime.weight_sync import delta
from primebuild.runtime.weight_sync.broadcast import BroadcastReceiver, BroadcastSender


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def roundtrip(previous: torch.Tensor, current: torch.Tensor) -> tuple[int, torch.Tensor]:
    code, changed, payload = delta.encode(previous, current)
    base = previous.clone()
    # the payload arrives at an aligned offset of a bucket: give it one
    wire = torch.zeros(payload.numel() + 64, dtype=torch.uint8)[64:]
    wire.copy_(payload)
    delta.apply(base, code, changed, wire)
    assert torch.equal(bits(base), bits(current))
    return code, payload


def test_each_encoding_rebuilds_the_bits_and_is_chosen_by_size():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, generator=g).to(torch.bfloat16)
    assert roundtrip(w, w.clone())[0] == delta.SAME
    few = w.clone()
    few[[3, 500, 999]] += 1
    code, payload = roundtrip(w, few)
    assert code == delta.INDICES and payload.numel() == 8 + 3 * 4  # 3 bf16 values padded to 8, 3 int32
    some = w.clone()
    some[::10] *= 2  # 10%: a bit per element beats 4 bytes per change
    code, payload = roundtrip(w, some)
    assert code == delta.MASK and payload.numel() == 200 + 125
    assert roundtrip(w, torch.randn(1000, generator=g).to(torch.bfloat16))[0] == delta.FULL


def test_sign_of_zero_and_nan_payloads_travel_although_they_compare_equal_or_never():
    zeros = torch.zeros(64)
    negative = zeros.clone()
    negative[5] = -0.0  # == 0.0, different bits
    assert roundtrip(zeros, negative)[0] == delta.INDICES
    nan = torch.full((64,), float("nan"))
    other_nan = nan.clone()
    bits(other_nan)[7] = 0x7FC00001  # another NaN payload
    assert roundtrip(nan, other_nan)[0] == delta.INDICES
    assert roundtrip(nan, nan.clone())[0] == delta.SAME  # NaN != NaN, yet nothing changed
    flags = torch.zeros(20, dtype=torch.bool)
    assert roundtrip(flags, flags.logical_not())[0] == delta.FULL


def model_states(steps: int, lr: float) -> list[dict[str, torch.Tensor]]:
    """A bf16 model's published weights after each of `steps` small updates of fp32 master weights."""
    g = torch.Generator().manual_seed(1)
    master = {"model.embed_tokens.weight": torch.randn(64, 32, generator=g) * 0.02,
              **{f"model.layers.{i}.mlp.weight": torch.randn(96, 32, generator=g) * 0.02 for i in range(3)},
              "model.norm.weight": torch.ones(32)}
    states = []
    for _ in range(steps):
        states.append({k: v.to(torch.bfloat16) for k, v in master.items()})
        for v in master.values():  # an Adam-like step: every weight moves by about lr
            v += lr * torch.sign(torch.randn(v.shape, generator=g))
    return states


def delta_sender(init, steps, lr, queue):
    torch.set_num_threads(1)
    sender = BroadcastSender(init, 2, timeout_s=60, bucket_mb=0.01, delta=True)
    stats = [sender.send(state, step) for step, state in enumerate(model_states(steps, lr), start=1)]
    sender.close()
    queue.put([(s.full_bytes, s.wire_bytes, s.encodings) for s in stats])


@pytest.mark.timeout(90)
def test_receiver_is_bit_equal_to_sender_after_several_delta_syncs():
    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=delta_sender, args=(init, 5, 1e-6, queue))
    proc.start()
    try:
        receiver = BroadcastReceiver(init, 2, 1, timeout_s=60)
        got = []
        while (update := receiver.recv()) is not None:
            got.append(update)
        stats = queue.get(timeout=30)
    finally:
        proc.join(30)
    assert proc.exitcode == 0
    want = model_states(5, 1e-6)
    assert [step for step, _ in got] == [1, 2, 3, 4, 5]
    for (_, state), expected in zip(got, want, strict=True):
        assert list(state) == list(expected)
        for name, tensor in expected.items():
            assert state[name].dtype == tensor.dtype and torch.equal(bits(state[name]), bits(tensor)), name
    full, first_wire, first_codes = stats[0]
    assert first_codes == {"full": 5}  # nothing to compare with yet
    for full_bytes, wire, codes in stats[1:]:
        # at lr 1e-6 on weights of ~0.02 (a bf16 step there is ~8e-5) few bf16 values change per step
        assert wire < full_bytes / 4, (wire, full_bytes, codes)
        assert codes.get("same", 0) == 1  # the norm: 1 +- 1e-6 rounds back to 1.0 in bf16
