"""Greedy evaluation: the lean batched loop must decode exactly what `generate` decodes."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from primebuild.runtime.envs.base import Task  # noqa: E402
from primebuild.runtime.envs.reverse_text import ReverseTextEnv  # noqa: E402
from primebuild.runtime.evaluate import (  # noqa: E402
    evaluate_greedy,
    evaluate_model,
    greedy_complete,
    load_hf_folder,
)
from primebuild.runtime.models.tiny import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("eval") / "tiny", seed=3)


def test_greedy_loop_matches_generate_with_left_padding(model_dir):
    model, tokenizer = load_hf_folder(model_dir)
    prompts = ["ab>", "hello>", "abcdefghijkl>", "zz>"]  # different lengths -> left padding
    ours = greedy_complete(model, tokenizer, prompts, max_new_tokens=10)
    for prompt, completion in zip(prompts, ours, strict=True):
        # One prompt at a time: no padding at all in the reference.
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        reference = out[0, ids.shape[1] :].tolist()
        if tokenizer.eos_token_id in reference:
            reference = reference[: reference.index(tokenizer.eos_token_id)]
        assert completion == tokenizer.decode(reference, skip_special_tokens=True)


def test_random_init_scores_low_and_evaluation_is_fast(model_dir):
    env = ReverseTextEnv()
    started = time.perf_counter()
    reward = evaluate_greedy(model_dir, env)
    assert 0.0 <= reward < 0.2
    assert time.perf_counter() - started < 30  # a couple of seconds normally; generous on a busy box


class _EchoEnv(ReverseTextEnv):
    """Scores 1 when the completion is whatever the model produced last time (self-consistency)."""

    def __init__(self, expected: dict[str, str]):
        super().__init__(num_eval=len(expected))
        self._expected = expected
        self._eval = [Task(prompt=p, answer=a) for p, a in expected.items()]

    def score(self, task, completion):
        return float(completion == task.answer)


def test_batching_does_not_change_the_completions(model_dir):
    model, tokenizer = load_hf_folder(model_dir)
    env = ReverseTextEnv(num_eval=12)
    prompts = [env.format_prompt(t) for t in env.eval_tasks()]
    one_batch = greedy_complete(model, tokenizer, prompts)
    expected = {t.prompt: c for t, c in zip(env.eval_tasks(), one_batch, strict=True)}
    # Scored in batches of 5 (uneven last batch), every completion must still match the one-batch run.
    assert evaluate_model(model, tokenizer, _EchoEnv(expected), batch_size=5) == 1.0
    assert not model.training
