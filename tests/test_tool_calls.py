"""OpenAI tool calls: the hermes parser, `/v1/chat/completions` with `tools` on the embedded engine, vLLM's
flags from the plan, and the interception that records an agent's tool-using episode token in / token out.

The model is the tiny chat model taught (in seconds, once per session: conftest `tool_caller_model`) to answer
any user with a `lookup` tool call and any tool result with `done`: a real model whose greedy answers hold real
tool calls."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import pytest
from chat_helpers import CALL, TOOLS
from inference_helpers import ADMIN_TOKEN, Served, running_server
from transformers import AutoTokenizer

from primebuild.builders.vllm_command import VllmServer, server_argv
from primebuild.runtime.envs.chat_interception import ChatInterception
from primebuild.runtime.inference.chat_template import ChatTemplate
from primebuild.runtime.inference.tool_parser import parse_tool_calls
from primebuild.runtime.orchestrator.client import InferenceClient


def test_the_hermes_parser_reads_calls_and_leaves_broken_ones_as_text():
    parsed = parse_tool_calls("hermes", f"let me see {CALL}")
    assert parsed.content == "let me see"
    (call,) = parsed.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "lookup" and json.loads(call["function"]["arguments"]) == {"key": "ab"}
    for broken in ('<tool_call>{"name": "lookup", "arguments": }</tool_call>', "<tool_call>[1]</tool_call>",
                   "no call at all"):
        assert parse_tool_calls("hermes", broken).tool_calls == [] and parse_tool_calls("hermes", broken).content == broken
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        parse_tool_calls("mistral", CALL)


def test_vllm_gets_the_tool_call_flags_only_when_asked():
    base = VllmServer(python="py", model_path="m", served_model_name="x", port=8000)
    assert "--enable-auto-tool-choice" not in server_argv(base)
    argv = server_argv(VllmServer(python="py", model_path="m", served_model_name="x", port=8000,
                                  tool_call_parser="hermes"))
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in argv


@pytest.fixture(scope="module")
def tool_model(tool_caller_model):
    """The tiny chat model taught to call `lookup` (conftest: trained once per session, shared with
    tests/test_vllm_tool_calls.py)."""
    return tool_caller_model


@contextlib.contextmanager
def serve(folder, tool_call_parser: str | None = "hermes"):
    from primebuild.runtime.inference.engine import Engine
    from primebuild.runtime.inference.server import create_app
    from primebuild.runtime.inference.tokenizer import ServedTokenizer

    tokenizer = ServedTokenizer(folder)
    engine = Engine(folder, device="cpu", eos_token_ids=tokenizer.eos_token_ids, detokenize=tokenizer.decode,
                    max_num_seqs=8, max_model_len=1024)
    app = create_app(engine, tokenizer, served_model_name="tiny", admin_token=ADMIN_TOKEN,
                     tool_call_parser=tool_call_parser)
    try:
        with running_server(app) as url:
            yield Served(url, engine)
    finally:
        engine.shutdown()


def test_chat_completions_answer_tool_calls_on_the_embedded_engine(tool_model):
    messages = [{"role": "user", "content": "what is ab"}]
    with serve(tool_model) as served:
        client = served.openai()
        answer = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0,
                                                max_tokens=80, logprobs=True)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"key": "ab"}
        extra = choice.model_extra
        tokenizer = AutoTokenizer.from_pretrained(tool_model)
        assert tokenizer.decode(extra["token_ids"]) == CALL + "<|im_end|>"  # what was sampled, ids included
        assert len(choice.logprobs.content) == len(extra["token_ids"])
        # the template rendered the tools: the prompt holds their signature
        assert '{"name": "lookup"' in tokenizer.decode(extra["prompt_token_ids"])
        # the call and its result go back in, rendered by the template; the model then answers
        follow = client.chat.completions.create(model="tiny", tools=TOOLS, temperature=0, max_tokens=20, messages=[
            *messages, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "xy"}])
        assert follow.choices[0].message.content == "done" and follow.choices[0].finish_reason == "stop"
        # "none": the text as written, no parsing
        plain = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                               temperature=0, max_tokens=80)
        assert plain.choices[0].message.content == CALL and not plain.choices[0].message.tool_calls
    with serve(tool_model, tool_call_parser=None) as served:
        import openai

        with pytest.raises(openai.BadRequestError, match="tool-call parser"):
            served.openai().chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=8)


def test_the_interception_records_an_agents_tool_episode_token_for_token(tool_model):
    """An OpenAI client runs a tool loop against the interception; the recorded sequence is the prompt, the
    sampled call (ids as sampled), the template's tool turn, the sampled answer: nothing re-tokenised."""
    import openai

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    template = ChatTemplate(tokenizer)
    sampled: list[list[int]] = []

    with serve(tool_model) as served:
        async def play():
            client = InferenceClient(served.v1, "tiny")

            async def sample(prompt_ids, **kw):
                result = await client.complete(prompt_ids, top_p=1.0, **kw)
                sampled.append(list(result.choices[0].token_ids))
                return result

            interception = ChatInterception(template, sample, max_tokens_per_turn=80, seq_len=1024, temperature=0.0)
            await interception.start()
            try:
                conversation = interception.open(seed=1)
                agent = openai.AsyncOpenAI(base_url=interception.base_url(conversation), api_key="x", max_retries=0)
                messages = [{"role": "system", "content": "use tools"}, {"role": "user", "content": "ab?"}]
                for _ in range(3):
                    answer = await agent.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
                    message = answer.choices[0].message
                    messages.append(message.model_dump(exclude_none=True))
                    if not message.tool_calls:
                        break
                    for call in message.tool_calls:
                        key = json.loads(call.function.arguments)["key"]
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": key[::-1]})
                with pytest.raises(openai.BadRequestError, match="does not continue"):
                    await agent.chat.completions.create(model="policy", messages=messages[:2] + messages[3:],
                                                        tools=TOOLS)
                await agent.close()
                return messages, interception.close(conversation)
            finally:
                await interception.stop()
                await client.close()

        messages, transcript = asyncio.run(play())
    assert messages[-1] == {"role": "assistant", "content": "done"} and len(sampled) == 2
    assert messages[3] == {"role": "tool", "tool_call_id": messages[2]["tool_calls"][0]["id"], "content": "ba"}
    first, last = sampled
    assert transcript.prompt_ids == template.prompt_ids(messages[:2], tools=TOOLS)
    between = template.continuation_ids(first, [messages[3]], tools=TOOLS)
    assert transcript.completion_ids == first + between + last
    assert transcript.loss_mask == [1] * len(first) + [0] * len(between) + [1] * len(last)
    assert all(lp <= 0.0 for lp in transcript.logprobs) and transcript.turns == 2


def test_the_interception_serves_from_the_socket_it_bound(monkeypatch):
    """The episode endpoint's port is bound once and served from that very socket: a program that tries to
    take the port between the choice and the serving finds it in use. (When the choice released the port
    first, a busy machine's other program took it, uvicorn's bind failed and its sys.exit ended the
    orchestrator mid-run.)"""
    import errno
    import socket

    import httpx
    import uvicorn

    serve, rival, outcome = uvicorn.Server.serve, socket.socket(), []

    async def serve_after_a_rival(self, sockets=None):
        try:
            rival.bind(("127.0.0.1", self.config.port))  # held (not closed) until the test ends
            outcome.append("the rival took the port")
        except OSError as e:
            outcome.append(e.errno)
        return await serve(self, sockets)

    monkeypatch.setattr(uvicorn.Server, "serve", serve_after_a_rival)

    async def not_called(prompt_ids, **kw):
        raise AssertionError("nothing is sampled here")

    async def start_and_ask() -> int:
        interception = ChatInterception(None, not_called, max_tokens_per_turn=8, seq_len=64)  # type: ignore[arg-type]
        await interception.start()
        try:
            async with httpx.AsyncClient() as client:
                return (await client.get(f"{interception.url}/nowhere")).status_code
        finally:
            await interception.stop()

    try:
        assert asyncio.run(start_and_ask()) == 404  # served: FastAPI's answer to an unknown path
    finally:
        rival.close()
    assert outcome == [errno.EADDRINUSE]


LOOKUP_TASKSET = '''
import verifiers.v1 as vf


class Lookup(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the model calls `lookup`, not `lookup_lookup`

    @vf.tool
    async def lookup(self, key: str) -> str:
        """The value of a key."""
        return key[::-1]


class Row(vf.TaskData):
    answer: str = ""


class LookupTask(vf.Task[Row]):
    @classmethod
    def toolsets(cls, config):
        return [Lookup(vf.ToolsetConfig())]

    @vf.reward
    async def looked_up(self, trace) -> float:
        return float(any(m.role == "tool" and "ba" in str(m.content) for m in trace.messages))


class LookupTaskset(vf.Taskset[LookupTask, vf.TasksetConfig]):
    def load(self):
        for i in range(4):
            yield LookupTask(Row(prompt=f"what is key {i}?"), self.config.task)


__all__ = ["LookupTaskset"]

if __name__ == "__main__":  # verifiers serves the toolset by running this module
    Lookup.run()
'''


def test_a_verifiers_taskset_with_a_tool_plays_end_to_end(tool_model, tmp_path, monkeypatch):
    """verifiers' own null harness (its chat program, its MCP toolset server, its interception) plays a
    taskset whose task has a tool, its model endpoint being primebuild's interception over the embedded
    engine: the model calls `lookup`, verifiers runs it, the result comes back, the model answers; the
    task's own reward scores the trace, and the recorded sequence holds exactly the sampled ids."""
    pytest.importorskip("verifiers.v1", reason="verifiers is not installed")
    from primebuild.runtime.envs.registry import load_environment
    from primebuild.runtime.envs.verifiers_agents import VerifiersAgentEnvironment
    from primebuild.runtime.orchestrator.rollout import RolloutRunner

    (tmp_path / "pb_lookup_tools.py").write_text(LOOKUP_TASKSET)
    monkeypatch.syspath_prepend(str(tmp_path))
    # verifiers serves the toolset from a child process, which imports the taskset's module too
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    env = load_environment("verifiers:pb-lookup-tools", None, {"harness": "null", "max_turns": 3, "num_eval": 1})
    assert isinstance(env, VerifiersAgentEnvironment)
    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    runner = RolloutRunner(tokenizer, max_tokens_per_turn=80, seq_len=1024)
    sampled: list[list[int]] = []

    with serve(tool_model) as served:
        async def play():
            client = InferenceClient(served.v1, "tiny")

            async def sample(prompt_ids, **kw):
                result = await client.complete(prompt_ids, top_p=1.0, **kw)
                sampled.append(list(result.choices[0].token_ids))
                return result
            try:
                return await runner.group(sample, env, env.eval_tasks()[0], n=1, temperature=0.0, seed=1)
            finally:
                await client.close()

        (rollout,) = asyncio.run(play())
    t = rollout.transcript
    assert t.turns == 2 and len(sampled) == 2 and rollout.reward == 1.0
    first, last = sampled
    assert tokenizer.decode(first) == CALL + "<|im_end|>" and tokenizer.decode(last) == "done<|im_end|>"
    between = t.completion_ids[len(first):len(t.completion_ids) - len(last)]
    assert t.completion_ids == first + between + last
    assert t.loss_mask == [1] * len(first) + [0] * len(between) + [1] * len(last)
    assert "<tool_response>ba</tool_response>" in tokenizer.decode(between)  # verifiers ran the tool
    assert '"name": "lookup"' in tokenizer.decode(t.prompt_ids)  # the MCP tool, rendered by the template
