"""A bucketed weight broadcast in bounded memory: a receiving worker adds at most two buckets while it takes
an update, whatever the model's size (the old receiver staged the whole unsharded model, then loaded it).
Measured as peak RSS above the RSS before each update, per receiver process (tests/weight_sync_memory_worker.py),
over gloo with 2 and 4 receivers, on a 25 MB fp32 model of 6 layers (3.9 MB each) in 4 MB buckets: a
receiver whose next bucket arrives while it loads one holds two (7.4-7.6 MiB measured, 7.9 allowed), the
embedded engine's update, one at a time, one and a layer's temporaries (4.1-4.4 MiB).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port
from safetensors.torch import save_file

MB = 2**20
WORKER = Path(__file__).parent / "weight_sync_memory_worker.py"
LAYERS, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 6, 256, 1024, 4, 2, 64, 96
BUCKET_MB = 4.0


def make_model(path: Path) -> Path:
    """A dense Qwen3 folder in HF naming, written without transformers (config.json + one safetensors)."""
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    state = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": torch.ones(HIDDEN),
             "lm_head.weight": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        state |= {p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
                  p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                  p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                  p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
                  p + "self_attn.q_norm.weight": torch.ones(HEAD_DIM), p + "self_attn.k_norm.weight": torch.ones(HEAD_DIM),
                  p + "mlp.gate_proj.weight": w(INTER, HIDDEN), p + "mlp.up_proj.weight": w(INTER, HIDDEN),
                  p + "mlp.down_proj.weight": w(HIDDEN, INTER),
                  p + "input_layernorm.weight": torch.ones(HIDDEN), p + "post_attention_layernorm.weight": torch.ones(HIDDEN)}
    path.mkdir()
    save_file(state, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "max_position_embeddings": 256, "tie_word_embeddings": False}))
    return path


def run_group(model: Path, modes: list[str], out: Path) -> list[dict]:
    out.mkdir()
    init, world = f"tcp://127.0.0.1:{free_port()}", len(modes) + 1
    # A fixed mmap threshold: glibc returns every large freed block to the kernel at once, so peak RSS
    # measures the tensors alive at the peak (tests/test_trainer_sharded_load.py says why).
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(model), init, str(world), str(rank), mode,
                               str(BUCKET_MB), str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for rank, mode in enumerate(["send", *modes])]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 0, output[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("modes", [["copy", "engine"], ["copy", "copy", "copy", "engine"]],
                         ids=["2-receivers", "4-receivers"])
def test_a_receiver_adds_at_most_two_buckets_not_the_model(modes, tmp_path):
    model = make_model(tmp_path / "model")
    model_bytes = (model / "model.safetensors").stat().st_size
    sender, *receivers = run_group(model, modes, tmp_path / "ranks")
    print(json.dumps([sender, *receivers]))  # the measurement, with -s
    assert sender["buckets"] >= LAYERS  # about a layer a bucket: the model did not travel in one piece
    for r in receivers:
        assert r["weights_equal"], r
        assert r["largest_bucket"] <= BUCKET_MB * MB
        # the steady state (the second update); the old receiver added the model (25 MB) before loading it
        assert r["peaks"][-1] <= 2 * r["largest_bucket"], (r, model_bytes)
        if r["mode"] == "copy":  # the first update too, with gloo's first-use buffers (0.1-0.4 MB seen)
            assert r["peaks"][0] <= 2 * r["largest_bucket"] + MB, (r, model_bytes)
        else:
            # the engine's start-up weights that are kept as stored (o_proj, down: 1.25 MB a layer) are views
            # of the safetensors file's mapping, which stays mapped while any is served: the first update
            # adds their copies (measured 10.4-13.4 MiB; 4.1-4.6 MiB the second time), and gloo's first-use
            # buffers as in copy mode (a CI rehearsal with the 2 cores 99% busy saw 16.4 MiB, 0.7 over the bound
            # without them)
            assert r["peaks"][0] <= 2 * r["largest_bucket"] + LAYERS * 1.3 * MB + MB, (r, model_bytes)
