import os
import threading

import pytest
import torch
from safetensors.numpy import load_file

from primebuild.contracts.rollout import RolloutBatch, Sample
from primebuild.contracts.run_dir import RunDir
from primebuild.errors import UserError
from primebuild.runtime.rollout_file import load_batch, save_batch
from primebuild.runtime.trainer.batch import loss_normalizer, pack


def sample(p, c, adv=1.0, mask=None):
    return Sample(
        prompt_ids=list(range(1, p + 1)),
        completion_ids=list(range(100, 100 + c)),
        inference_logprobs=[-0.5 - 0.01 * i for i in range(c)],
        advantage=adv,
        reward=adv,
        policy_version=0,
        env_id="e",
        completion_mask=mask,
    )


def test_save_load_roundtrip_plain_data(tmp_path):
    b = RolloutBatch(step=3, samples=[sample(2, 3), sample(1, 1, mask=[0])], temperature=1.0, next_group=4)
    path = tmp_path / "rollouts" / "step_000003.safetensors"
    save_batch(path, b)
    assert os.listdir(path.parent) == ["step_000003.safetensors"]  # no temp file left behind
    # Plain arrays and a JSON header: any safetensors reader opens it, nothing is unpickled.
    assert load_file(path)["samples.0.completion_ids"].tolist() == [100, 101, 102]
    got = load_batch(path)
    assert got == b


def test_a_batch_of_the_older_writers_still_loads(tmp_path):
    # format 1 (torch.save of plain data, `.pt`); before the typed RolloutBatch it also carried metadata
    # keys nothing reads. A run folder from before format 2 resumes: RunDir.rollout names its `.pt` files.
    path = tmp_path / "rollouts" / "step_000001.pt"
    path.parent.mkdir()
    torch.save({"format": 1, "step": 1, "samples": [sample(2, 3).model_dump()],
                "metadata": {"max_completion_tokens": 16, "temperature": 0.7, "groups": [0], "next_group": 1}}, path)
    got = load_batch(path)
    assert (got.temperature, got.next_group, got.samples) == (0.7, 1, [sample(2, 3)])
    assert RunDir(tmp_path).rollout(1) == path and RunDir(tmp_path).rollout(2).name == "step_000002.safetensors"


def test_concurrent_reader_never_sees_partial_file(tmp_path):
    path = tmp_path / "step.safetensors"
    big = RolloutBatch(step=1, samples=[sample(50, 400) for _ in range(40)])
    stop = threading.Event()
    seen = []

    def reader():
        while not stop.is_set():
            if path.exists():
                seen.append(len(load_batch(path).samples))

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(5):
        save_batch(path, big)
    stop.set()
    t.join()
    assert set(seen) <= {40}


def test_load_rejects_mismatched_logprobs(tmp_path):
    bad = sample(2, 3)
    bad.inference_logprobs = [-1.0]
    save_batch(tmp_path / "b.safetensors", RolloutBatch(step=1, samples=[bad]))
    with pytest.raises(UserError, match="inference_logprobs"):
        load_batch(tmp_path / "b.safetensors")


def test_load_names_a_file_that_is_not_a_batch(tmp_path):
    (tmp_path / "step_000001.safetensors").write_bytes(b"not a batch")
    with pytest.raises(UserError, match="not a primebuild rollout batch"):
        load_batch(tmp_path / "step_000001.safetensors")


def test_pack_packs_documents_within_the_budget_with_their_own_positions():
    samples = [sample(3, 5, adv=0.5), sample(2, 2, adv=-1.0), sample(4, 10), sample(1, 1), sample(2, 3), sample(9, 12)]
    per_rank = pack(samples, micro_batch_tokens=16, world_size=2)
    assert len(per_rank) == 2 and len(per_rank[0]) == len(per_rank[1])
    seen = []
    for mbs in per_rank:
        for mb in mbs:
            if mb.is_empty:
                assert not mb.loss_mask.any()
                continue
            rows, width = mb.input_ids.shape
            assert rows == 1 and (width <= 16 or len(mb.sample_indices) == 1)  # a lone over-long sample is allowed
            assert bool(mb.real_tokens.all())  # packed: no padding at all
            start = 0
            for doc, i in enumerate(mb.sample_indices):
                s = samples[i]
                p, c = len(s.prompt_ids), len(s.completion_ids)
                span = slice(start, start + p + c)
                assert mb.input_ids[0, span].tolist() == s.prompt_ids + s.completion_ids
                assert mb.position_ids[0, span].tolist() == list(range(p + c))
                assert (mb.document_ids[0, span] == doc).all()
                assert mb.loss_mask[0, span].nonzero().flatten().tolist() == list(range(p, p + c))
                assert mb.inference_logprobs[0, start + p: start + p + c].tolist() == pytest.approx(s.inference_logprobs)
                assert (mb.advantages[0, start + p: start + p + c] == s.advantage).all()
                seen.append(i)
                start += p + c
            assert start == width
    assert sorted(seen) == list(range(len(samples)))
    # ranks balanced by tokens: 9+12=21 (alone), then 14, 8, 5, 4, 2 first-fit into 16-token rows
    loads = sorted(sum(mb.num_tokens for mb in mbs if not mb.is_empty) for mbs in per_rank)
    assert loads[1] - loads[0] <= 21


def test_packing_wastes_nothing_where_right_padding_wasted_a_third():
    """The main job's shape: prompts of 5-30 tokens, completions of 1-16, 512-token micro-batches."""
    g = torch.Generator().manual_seed(0)
    samples = [sample(int(torch.randint(5, 31, (1,), generator=g)), int(torch.randint(1, 17, (1,), generator=g)))
               for _ in range(128)]
    mbs = pack(samples, micro_batch_tokens=512, world_size=1)[0]
    real = sum(int(mb.real_tokens.sum()) for mb in mbs)
    assert real == sum(s.num_tokens for s in samples)
    assert real / sum(mb.num_tokens for mb in mbs) == 1.0
    assert len(mbs) == -(-real // 512) or len(mbs) == -(-real // 512) + 1  # first-fit fills the rows


def test_pack_pads_ranks_with_empty_micro_batches():
    per_rank = pack([sample(2, 2)], micro_batch_tokens=64, world_size=3)
    assert [len(r) for r in per_rank] == [1, 1, 1]
    assert sum(mb.is_empty for r in per_rank for mb in r) == 2


def test_pack_respects_completion_mask():
    mb = pack([sample(2, 3, mask=[1, 0, 1])], 64, 1)[0][0]
    assert mb.loss_mask[0].tolist() == [False, False, True, False, True]


def test_padding_for_a_context_split_is_a_document_of_its_own():
    from primebuild.runtime.trainer.batch import pad_columns

    mb = pad_columns(pack([sample(2, 3), sample(1, 2)], 64, 1)[0][0], 12, pad_id=0)
    assert mb.input_ids.shape == (1, 12)
    assert mb.document_ids[0, -4:].tolist() == [-1] * 4 and not mb.real_tokens[0, -4:].any()
    assert not mb.loss_mask[0, -4:].any()


def test_loss_normalizer_is_a_step_constant():
    samples = [sample(2, 3), sample(1, 5, mask=[1, 1, 0, 0, 0])]
    assert loss_normalizer(samples, "step_tokens", None) == 5.0
    assert loss_normalizer(samples, "samples_x_max_tokens", 8) == 16.0
    with pytest.raises(UserError, match="max_completion_tokens"):
        loss_normalizer(samples, "samples_x_max_tokens", None)
