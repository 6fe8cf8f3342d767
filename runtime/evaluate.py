"""Greedy evaluation: mean reward of a model over an environment's fixed held-out tasks.

A lean batched loop on the HF model instead of `generate`: prompts are left-padded into one batch,
every step re-runs the whole (short) sequence and appends the argmax token. Without a KV cache there
is no cache bookkeeping to get wrong, and on the tiny model (sequences under 30 tokens) a step is a
few milliseconds, so 200 prompts take well under a second. Left padding needs explicit
`position_ids = cumsum(attention_mask) - 1` so that each prompt starts at position 0.
"""

from __future__ import annotations

from pathlib import Path

from primebuild.runtime.envs.base import Environment, Task


def greedy_complete(model, tokenizer, prompts: list[str], max_new_tokens: int = 16) -> list[str]:
    """Greedy completions of `prompts` (text after the prompt, up to and without `<eos>`)."""
    import torch

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    prompt_len = ids.shape[1]
    finished = torch.zeros(len(prompts), dtype=torch.bool)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(
                input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1
            ).logits
            next_token = logits[:, -1].argmax(-1)
            # A finished row keeps emitting padding that attention ignores.
            next_token = torch.where(finished, torch.full_like(next_token, pad), next_token)
            ids = torch.cat([ids, next_token[:, None]], dim=1)
            mask = torch.cat([mask, (~finished).long()[:, None]], dim=1)
            finished |= next_token == eos
            if bool(finished.all()):
                break
    completions = []
    for row in ids[:, prompt_len:].tolist():
        if eos in row:
            row = row[: row.index(eos)]
        completions.append(tokenizer.decode(row, skip_special_tokens=True))
    return completions


def evaluate_model(
    model, tokenizer, env: Environment, n: int = 200, max_new_tokens: int = 16, batch_size: int = 200
) -> float:
    """Mean reward of greedy completions over the first `n` of `env.eval_tasks()`."""
    return evaluate_tasks(model, tokenizer, env, env.eval_tasks()[:n], max_new_tokens, batch_size)


def evaluate_tasks(
    model, tokenizer, env: Environment, tasks: list[Task], max_new_tokens: int = 16, batch_size: int = 200
) -> float:
    """Mean reward of greedy completions over `tasks`, scored by `env`."""
    if not tasks:
        raise ValueError("no tasks to evaluate")
    was_training = model.training
    model.eval()
    try:
        rewards = []
        for start in range(0, len(tasks), batch_size):
            chunk = tasks[start : start + batch_size]
            completions = greedy_complete(
                model, tokenizer, [env.format_prompt(t) for t in chunk], max_new_tokens
            )
            rewards += [env.score(t, c) for t, c in zip(chunk, completions, strict=True)]
    finally:
        model.train(was_training)
    return sum(rewards) / len(rewards)


def load_hf_folder(model_dir: str | Path):
    """(model, tokenizer) from an HF folder, in fp32 on CPU, ready for inference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def evaluate_greedy(
    model_dir: str | Path,
    env: Environment,
    n: int = 200,
    max_new_tokens: int = 16,
    batch_size: int = 200,
) -> float:
    """Mean greedy reward of the model in `model_dir` over `env`'s fixed eval tasks."""
    model, tokenizer = load_hf_folder(model_dir)
    return evaluate_model(model, tokenizer, env, n=n, max_new_tokens=max_new_tokens, batch_size=batch_size)
