"""Packed micro-batches score every token as if its sample were alone: attention stays in its document."""

import pytest
import torch
from trainer_fixtures import hf_completion_logprobs, make_batch, make_tiny_model

from primebuild.runtime.trainer.batch import pack
from primebuild.runtime.trainer.model import DistEnv, Policy, load_model


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_packed_logprobs_equal_each_sample_alone(tmp_path, moe):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "model", moe=moe, seed=4)
    policy = load_model(str(path), DistEnv(0, 1, torch.device("cpu")), "float32", False, 16)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # a model whose config asks for a KV cache (as every pretrained one does): the document mask must hold too
    cached = Policy(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), chunk_tokens=16)
    samples = make_batch(hf, step=1, num_prompts=4, group_size=4).samples
    (mbs,) = pack(samples, micro_batch_tokens=64, world_size=1)
    assert any(len(mb.sample_indices) > 3 for mb in mbs)  # really packed
    checked = 0
    for mb in mbs:
        with torch.no_grad():
            lp, _ = policy(mb.input_ids, mb.position_ids, 1.0)
            torch.testing.assert_close(cached(mb.input_ids, mb.position_ids, 1.0)[0], lp, atol=1e-6, rtol=0)
        start = 0
        for i in mb.sample_indices:
            s = samples[i]
            alone = torch.tensor(hf_completion_logprobs(hf, s.prompt_ids, s.completion_ids))
            p, c = len(s.prompt_ids), len(s.completion_ids)
            torch.testing.assert_close(lp[0, start + p: start + p + c], alone, atol=1e-5, rtol=0)
            start += p + c
            checked += 1
    assert checked == len(samples)
