"""Greedy evaluation: mean reward of a model over an environment's fixed held-out tasks.

Multi-turn environments are played turn by turn (`play_greedy`), with the same token bookkeeping as
the orchestrator's rollouts (primebuild/runtime/envs/transcript.py).

A lean batched loop on the HF model instead of `generate` (which spends most of its time in
per-call Python set-up on a model this small): prompts are left-padded into one batch, a first
forward fills the KV cache, then each step feeds only the argmax token of every row. Left padding
needs explicit `position_ids = cumsum(attention_mask) - 1` so that each prompt starts at position 0.
The KV cache matters even here: re-running whole sequences made 200 prompts cost ~2 s instead of a
fraction of that.
"""

from __future__ import annotations

from pathlib import Path

from primebuild.runtime.envs.base import Environment, Task


def greedy_complete(model, tokenizer, prompts: list[str], max_new_tokens: int = 16) -> list[str]:
    """Greedy completions of `prompts` (text after the prompt, up to and without `<eos>`)."""
    eos = tokenizer.eos_token_id
    rows = greedy_ids(model, [list(tokenizer(p)["input_ids"]) for p in prompts], max_new_tokens,
                      eos_id=eos, pad_id=tokenizer.pad_token_id)
    return [tokenizer.decode(row[: row.index(eos)] if eos in row else row, skip_special_tokens=True)
            for row in rows]


def greedy_ids(model, prompts: list[list[int]], max_new_tokens: int, *, eos_id: int, pad_id: int) -> list[list[int]]:
    """Greedy continuations of token-id prompts: each row's new ids, up to and including `<eos>`."""
    import torch

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # left-padded
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache_arg = _cache_argument_name(model)
    finished = torch.zeros(len(prompts), dtype=torch.bool)
    generated = []
    cache = None
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{cache_arg: cache},
            )
            cache = out.cache if cache_arg == "cache" else out.past_key_values
            next_token = out.logits[:, -1].argmax(-1)
            # A finished row keeps emitting padding, which the attention mask hides.
            next_token = torch.where(finished, torch.full_like(next_token, pad_id), next_token)
            generated.append(next_token)
            mask = torch.cat([mask, (~finished).long()[:, None]], dim=1)
            finished |= next_token == eos_id
            if bool(finished.all()):
                break
            # Only the new token goes in next time; the cache holds the rest.
            ids, positions = next_token[:, None], positions[:, -1:] + 1
    rows = torch.stack(generated, dim=1).tolist() if generated else [[] for _ in prompts]
    return [row[: row.index(eos_id) + 1] if eos_id in row else row for row in rows]


def play_greedy(model, tokenizer, env: Environment, tasks: list[Task], max_new_tokens: int = 16,
                seq_len: int | None = None) -> list[float]:
    """Rewards of greedy episodes (one turn for a single-turn environment): every active episode's
    next turn is decoded in one batch, token in / token out as the orchestrator does (transcript.py)."""
    from primebuild.runtime.envs.base import episode_reward, max_turns, start_episode
    from primebuild.runtime.envs.framing import framing
    from primebuild.runtime.envs.transcript import Transcript

    async def play() -> list[float]:
        eos = tokenizer.eos_token_id
        framed = framing(env, tokenizer)
        transcripts = [Transcript(framed.prompt_ids(t)) for t in tasks]
        episodes = [start_episode(env, t) for t in tasks]
        active = list(range(len(tasks)))
        try:
            for _ in range(max_turns(env)):
                if not active:
                    break
                turns = greedy_ids(model, [transcripts[i].ids for i in active], max_new_tokens, eos_id=eos,
                                   pad_id=tokenizer.pad_token_id)
                still = []
                for i, turn in zip(active, turns, strict=True):
                    transcripts[i].add_model_turn(turn)
                    text = tokenizer.decode([t for t in turn if t != eos], skip_special_tokens=True)
                    reply = await episodes[i].step(text)
                    if reply is None:
                        continue
                    transcripts[i].add_environment(framed.reply_ids(tasks[i], turn, reply))
                    if seq_len is None or len(transcripts[i]) + max_new_tokens <= seq_len:
                        still.append(i)
                active = still
            return [await episode_reward(env, e) for e in episodes]
        finally:
            for e in episodes:
                await e.close()

    return _run(play())


def _run(coro):
    import asyncio

    from primebuild.runtime.envs.verifiers_adapter import _run_coroutine

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    return _run_coroutine(coro)


def _cache_argument_name(model) -> str:
    """transformers 5 renamed `past_key_values` to `cache` (calibration.md); accept both."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def evaluate_model(
    model, tokenizer, env: Environment, n: int = 200, max_new_tokens: int = 16, batch_size: int = 200
) -> float:
    """Mean reward of greedy completions over the first `n` of `env.eval_tasks()`."""
    return evaluate_tasks(model, tokenizer, env, env.eval_tasks()[:n], max_new_tokens, batch_size)


def evaluate_tasks(
    model, tokenizer, env: Environment, tasks: list[Task], max_new_tokens: int = 16, batch_size: int = 200
) -> float:
    """Mean reward of greedy episodes over `tasks`, scored by `env`."""
    if not tasks:
        raise ValueError("no tasks to evaluate")
    was_training = model.training
    model.eval()
    try:
        rewards = []
        for start in range(0, len(tasks), batch_size):
            rewards += play_greedy(model, tokenizer, env, tasks[start : start + batch_size], max_new_tokens)
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
