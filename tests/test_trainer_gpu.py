"""The trainer on CUDA (one GPU, no process group): fp32 matches an HF forward, bf16 compute trains."""

import pytest
import torch
from trainer_fixtures import make_tiny_model, trainer_config, write_rollouts
from transformers import AutoModelForCausalLM

from primebuild.runtime.metrics import read_metrics
from primebuild.runtime.trainer.main import run_trainer
from primebuild.runtime.weight_sync.filesystem import step_folder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_training(tmp_path, dtype):
    model = make_tiny_model(tmp_path / "model")
    run = tmp_path / "run"
    write_rollouts(run, model, range(1, 3))  # inference log-probs from a CPU fp32 HF forward
    cfg = trainer_config(model_path=str(model), run_dir=str(run), max_steps=2, lr=1e-3,
                         precision={"float32": "fp32", "bfloat16": "bf16"}[dtype], weight_dtype=dtype,
                         checkpoint_every=1, activation_checkpointing=(dtype == "bfloat16"))
    run_trainer(cfg)
    m = read_metrics(run / "metrics.jsonl")
    print(dtype, {s: {k: m[s][k] for k in ("loss", "mismatch_kl", "grad_norm", "step_s")} for s in m})
    if dtype == "float32":
        assert m[1]["mismatch_kl"] < 1e-6
    else:
        assert m[1]["mismatch_kl"] < 1e-2  # bf16 compute against fp32 sampling: small but not zero
    folder = step_folder(run / "weights", 2)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert loaded.dtype == (torch.float32 if dtype == "float32" else torch.bfloat16)
