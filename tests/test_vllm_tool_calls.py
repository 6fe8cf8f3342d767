"""The same tool calls through vLLM: the plan's flags (--enable-auto-tool-choice --tool-call-parser hermes)
make vLLM's chat endpoint render the tools with the model's own template and answer OpenAI `tool_calls`;
the model is the tiny chat model taught to call `lookup` (tests/chat_helpers.py, conftest `tool_caller_model`)."""

from __future__ import annotations

import json

import httpx
import pytest
from chat_helpers import TOOLS
from vllm_helpers import START_TIMEOUT_S, VLLM_ADMIN_TOKEN, VllmServer

from primebuild.builders.vllm_command import VllmServer as ServerSpec
from primebuild.builders.vllm_command import server_argv

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_vllm_answers_tool_calls_with_the_plans_flags(tool_caller_model, tmp_path):
    model = tool_caller_model  # taught once per session (conftest), shared with tests/test_tool_calls.py
    planned = server_argv(ServerSpec(python="python", model_path=str(model), served_model_name="tiny", port=1,
                                     tool_call_parser="hermes"))
    flags = tuple(planned[planned.index("--enable-auto-tool-choice"):])  # what inference.tool_call_parser adds
    server = VllmServer(model, tmp_path / "server.log", admin_token=VLLM_ADMIN_TOKEN, max_model_len=1024,
                        extra_argv=flags)
    try:
        server.wait_healthy(START_TIMEOUT_S)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "what is ab"}], "tools": TOOLS,
                "temperature": 0, "max_tokens": 80}
        answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls", answer
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "lookup" and json.loads(call["function"]["arguments"]) == {"key": "ab"}
    finally:
        server.stop()
