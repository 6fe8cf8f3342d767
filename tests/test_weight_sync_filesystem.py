"""Atomic step folders: a reader never sees a folder without STABLE or a stable folder missing files."""

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from primebuild.runtime.weight_sync.filesystem import (
    STABLE,
    is_stable,
    latest_stable,
    prune,
    publish_dir,
    publish_hf_weights,
    stable_steps,
    step_folder,
    wait_for_step,
)
from primebuild.runtime.weight_sync.safetensors_stream import write_safetensors
from primebuild.runtime.weight_sync.stream import TensorSpec


def test_reader_never_sees_partial_folder(tmp_path):
    root = tmp_path / "weights"
    root.mkdir()
    problems, stop = [], threading.Event()

    def write(d):
        for i in range(20):
            (d / f"part{i}.bin").write_bytes(b"x" * 20_000)

    def listing(p):
        try:
            return {q.name for q in p.iterdir()}
        except FileNotFoundError:
            return set()  # vanished for an instant while a step was replaced: allowed

    def reader():
        while not stop.is_set():
            for p in list(root.iterdir()):
                if p.name.startswith("step_"):
                    parts = {n for n in listing(p) if n.startswith("part")}
                    if len(parts) not in (0, 20):
                        problems.append(f"{p.name}: {len(parts)} parts visible")

    t = threading.Thread(target=reader)
    t.start()
    for step in range(1, 8):
        publish_dir(step_folder(root, step), write, step)
    publish_dir(step_folder(root, 3), write, 3)  # re-publishing a step replaces it whole
    stop.set()
    t.join()
    assert problems == []
    assert stable_steps(root) == list(range(1, 8))
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no staging/trash left


def test_failed_write_leaves_nothing(tmp_path):
    def boom(d):
        (d / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        publish_dir(step_folder(tmp_path, 1), boom, 1)
    assert list(tmp_path.iterdir()) == []
    assert latest_stable(tmp_path) is None


def test_unmarked_folder_is_ignored_and_wait_times_out(tmp_path):
    step_folder(tmp_path, 5).mkdir()  # e.g. copied by hand, never marked
    assert latest_stable(tmp_path) is None
    with pytest.raises(TimeoutError):
        wait_for_step(tmp_path, 5, timeout_s=0.3, poll_s=0.05)
    publish_dir(step_folder(tmp_path, 6), lambda d: None, 6)
    assert wait_for_step(tmp_path, 5, timeout_s=1) == step_folder(tmp_path, 6)


def test_a_step_written_again_with_the_same_bytes_stays_in_place(tmp_path):
    """A retrained step (trainer restart) publishes the same bytes: the folder a server may be loading is
    kept, not renamed away; other bytes replace it."""
    final = step_folder(tmp_path, 4)
    publish_dir(final, lambda d: (d / "model.safetensors").write_bytes(b"step 4"), step=4)
    inode, marker = final.stat().st_ino, (final / STABLE).read_text()
    publish_dir(final, lambda d: (d / "model.safetensors").write_bytes(b"step 4"), step=4)
    assert final.stat().st_ino == inode and (final / STABLE).read_text() == marker
    assert [p.name for p in tmp_path.iterdir()] == [final.name]  # no staging folder left beside it
    publish_dir(final, lambda d: (d / "model.safetensors").write_bytes(b"other"), step=4)
    assert final.stat().st_ino != inode and (final / "model.safetensors").read_bytes() == b"other"
    assert is_stable(final) and [p.name for p in tmp_path.iterdir()] == [final.name]


def test_prune_keeps_newest(tmp_path):
    for s in (1, 2, 3, 4):
        publish_dir(step_folder(tmp_path, s), lambda d: None, s)
    prune(tmp_path, keep_last=2)
    assert stable_steps(tmp_path) == [3, 4]


def test_hf_weights_roundtrip_with_tied_embeddings(tmp_path):
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    folder = publish_hf_weights(tmp_path / "weights", 1, model.state_dict(), model.config)
    assert is_stable(folder) and (folder / STABLE).is_file()
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


class Layers:
    """Streamed weights: a layout up front, then one group at a time; counts the groups handed out."""

    def __init__(self, groups):
        self._groups = groups
        self.layout = [TensorSpec(k, t.dtype, tuple(t.shape)) for g in groups for k, t in g]
        self.given = 0

    def groups(self):
        for g in self._groups:
            self.given += 1
            yield g


def test_streamed_safetensors_file_is_what_safetensors_reads(tmp_path):
    """The streamed writer (header from the layout, bytes as they come) writes a file safetensors reads
    back exactly, for every dtype the trainer publishes, 0-d and empty tensors included."""
    from safetensors import safe_open

    groups = [
        [("a.weight", torch.randn(3, 5)), ("a.bf16", torch.randn(4, 2).to(torch.bfloat16))],
        [("b.ids", torch.arange(7)), ("b.mask", torch.tensor([True, False, True])), ("b.scalar", torch.tensor(2.5))],
        [("c.empty", torch.empty(0, 4)), ("c.fp8", torch.randn(16).to(torch.float8_e4m3fn))],
    ]
    weights = Layers(groups)
    write_safetensors(tmp_path / "m.safetensors", weights, metadata={"format": "pt"})
    assert weights.given == 3
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert list(f.keys()) == sorted(k for g in groups for k, _ in g)
        for k, t in (kv for g in groups for kv in g):
            got = f.get_tensor(k)
            assert got.dtype == t.dtype and got.shape == t.shape, k
            assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k


def test_a_stream_that_breaks_its_layout_is_refused(tmp_path):
    weights = Layers([[("a", torch.zeros(2))]])
    weights.layout = [TensorSpec("a", torch.float32, (3,))]
    with pytest.raises(RuntimeError, match="layout says"):
        write_safetensors(tmp_path / "m.safetensors", weights)
