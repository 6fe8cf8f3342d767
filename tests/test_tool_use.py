"""tool-lookup, the chat environment with a tool (primebuild/runtime/envs/tool_lookup.py): its episodes, the held-out
split, SFT on its chat-templated demonstrations, and a short `primebuild run` of manifests/tool-use.yaml
whose rollouts hold the model's tool calls (trained) and the tool's results (masked out)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from pathlib import Path

import pytest
from conftest import free_port, run_cli, sft_workspace

from primebuild.builders.derivations import sft_config
from primebuild.manifest.load import load_manifest
from primebuild.runtime.envs.base import demonstration
from primebuild.runtime.envs.framing import ChatEnvironment, framing
from primebuild.runtime.envs.tool_lookup import UNKNOWN, ToolLookupEnv, is_eval_row, tool_call
from primebuild.runtime.models.chat_tokenizer import build_chat_tokenizer
from primebuild.runtime.rollout_file import load_batch
from primebuild.runtime.trainer.env_sft import episode_ids

MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"
# What tool-use-sft's training and held-out eval read, as tokens: the first 3 steps' demonstrations (ids and
# loss mask) and the 48 eval tasks' prompts and tool turns. Equal at 9cf91cc (the 2026-12-03 build that
# scored 0.479, transformers 5.24) and after its 2026-12-05 regression (transformers 5.25, the trainer's
# SFT): that regression was not in these tokens (docs/environments.md). A change here is a change of the
# template, tokenizer, framing or environment data, and tool-use-sft needs re-measuring.
SFT_STREAM_SHA256 = "5619d8fa892ff1df5053b5b0693773d3136eb6d6c1e963341004d3f1857edf2b"
EVAL_TOKENS_SHA256 = "8207e9d1cc46667dd78d261b293c2c597f44b46aca396a28cc434bc1d12fa3e7"


def play(env, task, turns):
    async def run():
        episode = env.start(task)
        replies = [await episode.step(t) for t in turns]
        return replies, await episode.reward()
    return asyncio.run(run())


def test_only_the_tool_knows_the_value_and_the_answer_after_it_scores():
    env = ToolLookupEnv(num_eval=20)
    assert isinstance(env, ChatEnvironment)
    task = env.sample_tasks(random.Random(0), 1)[0]
    key, value = task.info["key"], task.answer
    assert play(env, task, [tool_call(key), value]) == ([[{"role": "tool", "content": value}], None], 1.0)
    assert play(env, task, [tool_call(key + "x"), value])[0][0] == [{"role": "tool", "content": UNKNOWN}]
    assert play(env, task, ["abc"]) == ([None], float(value == "abc"))  # no call: the turn is the answer
    assert play(env, task, [tool_call(key)] * 3) == ([[{"role": "tool", "content": value}]] * 2 + [None], 0.0)
    # values are drawn per task: the same key comes with other values, so only the tool can say
    values = {t.answer for t in env.sample_tasks(random.Random(1), 2000) if t.info["key"] == key}
    assert len(values) > 1


@pytest.mark.parametrize("key_length", [2, 0])
def test_the_held_out_rows_never_come_up_in_training(key_length):
    env = ToolLookupEnv(key_length=key_length, num_eval=40)
    held_out = [(t.info["key"], t.answer) for t in env.eval_tasks()]
    assert len(set(held_out)) == 40 and all(is_eval_row(*row) for row in held_out)
    assert env.eval_tasks() == ToolLookupEnv(key_length=key_length, num_eval=40).eval_tasks()
    assert not any(is_eval_row(t.info["key"], t.answer) for t in env.sample_tasks(random.Random(2), 500))


def test_sft_learns_the_call_and_the_answer_in_the_chat_template_never_the_tool_result():
    tokenizer = build_chat_tokenizer()
    env = ToolLookupEnv(num_eval=10)
    framed = framing(env, tokenizer)
    task = env.sample_tasks(random.Random(3), 1)[0]
    row, mask = episode_ids(tokenizer, framed.prompt_ids(task), demonstration(env, task, random.Random(0)),
                            lambda sampled, reply: framed.reply_ids(task, sampled, reply))
    learned = tokenizer.decode([t for t, m in zip(row, mask, strict=True) if m])
    assert learned == tool_call(task.info["key"]) + "<|im_end|>" + task.answer + "<|im_end|>"
    given = tokenizer.decode(row)
    assert '"name": "lookup"' in given.split("<|im_start|>user")[0]  # the template rendered the tool
    assert f"<|im_start|>tool\n<tool_response>{task.answer}</tool_response><|im_end|>" in given


def test_a_short_run_records_tool_calls_trained_and_tool_results_masked(tmp_path):
    root = tmp_path / "ws"
    manifests = sft_workspace(root, ("tool-use.yaml",), sft="tool-use-sft.yaml",
                              # 9 of step 1's 16 rollouts call the tool; no mid-SFT held-out evals (greedy: the
                              # weights are the same without them), the finished model's is still made
                              sft_changes={"steps": 50, "warmup_steps": 10, "eval_every": 0})
    result = run_cli("run", manifests / "tool-use.yaml", "--set", "orchestrator.max_steps=1",
                     "--set", "orchestrator.rollouts_per_step=16", "--set", "orchestrator.eval_every=0",
                     "--set", "orchestrator.eval_prompts=8",  # the evals before and after RL: not what is checked
                     "--set", f"inference.port={free_port()}", "--runs-dir", root / "runs", timeout=900, env={"PRIMEBUILD_STORE": str(root / "store")})
    assert result.code == 0, result.text
    tokenizer = build_chat_tokenizer()
    (rollout,) = (root / "runs").glob("*/rollouts/step_000001.safetensors")
    samples = [s.model_dump() for s in load_batch(rollout).samples]
    call, response = (tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "<tool_response>"))
    with_tool = [s for s in samples if response in s["completion_ids"]]
    assert with_tool, [tokenizer.decode(s["completion_ids"]) for s in samples]
    for s in with_tool:
        ids, mask = s["completion_ids"], s["completion_mask"]
        assert mask[ids.index(call)] == 1 and mask[ids.index(response)] == 0
        tool_turn = tokenizer.decode(ids).split("<|im_start|>tool")[1].split("<|im_end|>")[0]
        first_turn = tokenizer.decode(ids[:ids.index(call) + 1])
        assert first_turn.endswith("<tool_call>") and "<tool_response>" in tool_turn
        # the tool's tokens carry no loss and no log-prob; the model's carry both
        env_tokens = [i for i, m in enumerate(mask) if m == 0]
        assert env_tokens and all(s["inference_logprobs"][i] == 0.0 for i in env_tokens)
        assert all(s["inference_logprobs"][i] < 0.0 for i, m in enumerate(mask) if m == 1)


def test_tool_use_sft_reads_the_tokens_its_measured_build_read():
    config = sft_config(load_manifest(MANIFESTS / "tool-use-sft.yaml"))
    tokenizer = build_chat_tokenizer()
    env = ToolLookupEnv(**config.env_args)
    framed, rng = framing(env, tokenizer), random.Random(config.seed)
    stream = hashlib.sha256()
    for _ in range(3):  # the SFT's first steps, drawn as trainer/env_sft.py draws them
        for task in env.sample_tasks(rng, config.batch_size):
            row = episode_ids(tokenizer, framed.prompt_ids(task), demonstration(env, task, rng),
                              lambda sampled, reply, task=task: framed.reply_ids(task, sampled, reply))
            stream.update(json.dumps(row).encode())
    held_out = hashlib.sha256()
    for task in env.eval_tasks():
        tool_turn = framed.reply_ids(task, tokenizer.encode("x") + [tokenizer.eos_token_id],
                                     [{"role": "tool", "content": task.answer}])
        held_out.update(json.dumps([framed.prompt_ids(task), task.answer, tool_turn]).encode())
    assert (stream.hexdigest(), held_out.hexdigest()) == (SFT_STREAM_SHA256, EVAL_TOKENS_SHA256)


def test_the_key_copying_warm_start_demonstrates_the_users_key_inside_the_call():
    """tool-use-keys-sft.yaml's demonstrations: the call carries the user's own 2-letter key (learned), so the
    warm start is taught to copy it; tool-use-keys.yaml trains on the same task."""
    config = sft_config(load_manifest(MANIFESTS / "tool-use-keys-sft.yaml"))
    rl_args = load_manifest(MANIFESTS / "tool-use-keys.yaml").manifest.environments[0].args
    assert config.env_args == rl_args and config.env_args["key_length"] == 2
    tokenizer = build_chat_tokenizer()
    env = ToolLookupEnv(**config.env_args)
    framed, rng = framing(env, tokenizer), random.Random(config.seed)
    tasks = env.sample_tasks(rng, 50)
    assert len({t.info["key"] for t in tasks}) > 10  # keys vary, so no one call fits every task
    for task in tasks:
        key = task.info["key"]
        assert len(key) == 2 and env.chat_messages(task) == [{"role": "user", "content": key}]
        row, mask = episode_ids(tokenizer, framed.prompt_ids(task), demonstration(env, task, rng),
                                lambda sampled, reply, task=task: framed.reply_ids(task, sampled, reply))
        learned = tokenizer.decode([t for t, m in zip(row, mask, strict=True) if m])
        assert learned.startswith(f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{key}"}}}}</tool_call>')
        assert learned.endswith(task.answer + "<|im_end|>")
        assert play(env, task, [learned.split("<|im_end|>")[0], task.answer])[1] == 1.0
