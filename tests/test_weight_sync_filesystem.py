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
