"""Chat templates token in / token out: the model's own jinja template renders the environment's turns,
and the sequence the trainer gets holds exactly the ids the engine sampled, turn after turn."""

from __future__ import annotations

import asyncio
import json

import pytest
from chat_helpers import save_chat_model
from inference_helpers import serve_folder
from transformers import AutoTokenizer

from primebuild.runtime.envs.base import Task
from primebuild.runtime.envs.framing import ChatEnvironment
from primebuild.runtime.inference.chat_template import ChatTemplate, TemplateError
from primebuild.runtime.models.chat_tokenizer import IM_END, build_chat_tokenizer
from primebuild.runtime.orchestrator.client import InferenceClient
from primebuild.runtime.orchestrator.rollout import RolloutRunner

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "the value of a key",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def test_the_template_renders_tools_calls_and_results(tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "key ab?"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": '{"key": "ab"}'}}]},
                {"role": "tool", "content": "xy"}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nbe brief\nTools:\n" + json.dumps(TOOLS[0]["function"]))
    assert '<|im_start|>assistant\n<tool_call>{"name": "lookup", "arguments": {"key": "ab"}}</tool_call><|im_end|>\n' in text
    assert text.endswith("<|im_start|>tool\n<tool_response>xy</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert "be brief" not in tokenizer.apply_chat_template(messages[1:2], tokenize=False)


def test_continuations_rebuild_the_templates_own_rendering(tokenizer):
    """Sampled turns that are what the template would write: prompt + sampled + continuation, turn after
    turn, equals the template's rendering of the whole conversation, with each sampled id at its place."""
    template = ChatTemplate(tokenizer)
    end = tokenizer.convert_tokens_to_ids(IM_END)
    conversation = [{"role": "user", "content": "hi"}]
    ids = template.prompt_ids(conversation, tools=TOOLS)
    replies = [[{"role": "tool", "content": "42"}], [{"role": "user", "content": "and b?"}],
               [{"role": "tool", "content": "7"}, {"role": "user", "content": "ok"}]]
    for turn, reply in enumerate(replies):
        sampled = tokenizer.encode(f"answer {turn}", add_special_tokens=False) + [end]
        at = len(ids)
        ids += sampled + template.continuation_ids(sampled, reply, tools=TOOLS)
        assert ids[at:at + len(sampled)] == sampled
        conversation += [{"role": "assistant", "content": f"answer {turn}"}, *reply]
        assert ids == template.render(conversation, tools=TOOLS)


def test_a_turn_cut_short_is_closed_by_the_template(tokenizer):
    template = ChatTemplate(tokenizer)
    cut = tokenizer.encode("abc", add_special_tokens=False)  # max_tokens hit: no <|im_end|> sampled
    close = template.continuation_ids(cut, [{"role": "user", "content": "go"}])
    assert tokenizer.decode(close) == "<|im_end|>\n<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n"


def test_templates_that_cannot_keep_sampled_tokens_are_refused(tokenizer):
    template = ChatTemplate(tokenizer)
    with pytest.raises(TemplateError, match="sampled, not rendered"):
        template.continuation_ids([1], [{"role": "assistant", "content": "x"}])
    rewriting = build_chat_tokenizer()  # renders only the last message: earlier turns are rewritten
    rewriting.chat_template = "{{ messages[-1].content }}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(TemplateError, match="appending"):
        ChatTemplate(rewriting).continuation_ids([1], [{"role": "user", "content": "x"}])


class EchoChat:
    """A chat environment of TURNS model turns: each reply is a user message (and a tool result)."""

    id, version, max_turns = "echo-chat", "1", 8

    def __init__(self, turns: int):
        self.turns = turns

    def chat_messages(self, task: Task) -> list[dict]:
        return [{"role": "system", "content": "chat"}, {"role": "user", "content": task.prompt}]

    def chat_tools(self, task: Task) -> list[dict] | None:
        return TOOLS

    def format_prompt(self, task: Task) -> str:
        return task.prompt

    def start(self, task: Task):
        return EchoEpisode(self.turns)

    def sample_tasks(self, rng, n):
        return [Task("hello", "")] * n

    def eval_tasks(self):
        return [Task("hello", "")]

    def score(self, task, completion):
        return 0.0

    def demonstration(self, task, rng):
        return []


class EchoEpisode:
    def __init__(self, turns: int):
        self.turns, self.seen = turns, []

    async def step(self, completion: str):
        self.seen.append(completion)
        if len(self.seen) >= self.turns:
            return None
        return [{"role": "tool", "content": f"r{len(self.seen)}"}, {"role": "user", "content": "more"}]

    async def reward(self) -> float:
        return 1.0

    async def close(self) -> None:
        pass


def test_a_chat_rollout_trains_exactly_the_sampled_tokens(tmp_path):
    """Four model turns through the embedded server: the transcript's model tokens are the ids the server
    returned, in order (compared id for id), and everything between them is the template's rendering."""
    env = EchoChat(turns=4)
    assert isinstance(env, ChatEnvironment)
    model = save_chat_model(tmp_path / "model", seed=1)
    tokenizer = AutoTokenizer.from_pretrained(model)
    template = ChatTemplate(tokenizer)
    runner = RolloutRunner(tokenizer, max_tokens_per_turn=8, seq_len=900)
    answers: list[list[int]] = []

    with serve_folder(model, max_model_len=900) as served:
        client = InferenceClient(served.v1, "tiny")

        async def play():
            async def sample(prompt_ids, **kw):
                result = await client.complete(prompt_ids, top_p=1.0, **kw)
                assert list(result.choices[0].prompt_token_ids) == list(prompt_ids)  # token in
                answers.append(list(result.choices[0].token_ids))
                return result
            try:
                return await runner.group(sample, env, Task("hello", ""), n=1, temperature=1.0, seed=3)
            finally:
                await client.close()

        (rollout,) = asyncio.run(play())
    t = rollout.transcript
    assert t.turns == 4 and rollout.finish == "episode" and len(answers) == 4
    assert t.prompt_ids == template.prompt_ids(env.chat_messages(Task("hello", "")), tools=TOOLS)
    model_spans, env_spans, position = [], [], 0
    for sampled in answers:  # walk the sequence: sampled turn, then the environment's rendered reply
        assert t.completion_ids[position:position + len(sampled)] == sampled
        assert t.loss_mask[position:position + len(sampled)] == [1] * len(sampled)
        model_spans.append(sampled)
        position += len(sampled)
        rest = t.loss_mask[position:]
        span = len(rest) if 1 not in rest else rest.index(1)
        env_spans.append(t.completion_ids[position:position + span])
        position += span
    assert position == len(t.completion_ids)
    assert sum(map(len, model_spans)) == t.model_tokens
    for turn, (sampled, reply) in enumerate(zip(answers[:-1], env_spans[:-1], strict=True)):
        expected = template.continuation_ids(sampled, [{"role": "tool", "content": f"r{turn + 1}"},
                                                       {"role": "user", "content": "more"}], tools=TOOLS)
        assert reply == expected
        assert "<tool_response>r" in tokenizer.decode(reply)
    assert env_spans[-1] == []  # the episode ended after the last model turn
