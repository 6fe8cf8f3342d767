"""Tool calls in a model's text, as OpenAI `tool_calls` (the hermes format, vLLM's `--tool-call-parser hermes`).

A hermes-style model writes each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the
text outside the calls is the message's content. A call whose JSON does not parse, or has no string
`name`, is not a call: the whole text stays content (what vLLM's hermes parser does with a broken call),
so the caller sees what the model wrote and the reward can punish it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

PARSERS = ("hermes",)  # the names a manifest may give (inference.tool_call_parser), vLLM's among them
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None
    tool_calls: list[dict]  # OpenAI's shape: {"id", "type": "function", "function": {"name", "arguments"}}


def parse_hermes(text: str) -> ParsedMessage:
    bodies = _CALL.findall(text)
    if not bodies:
        return ParsedMessage(text, [])
    calls = []
    for body in bodies:
        try:
            call = json.loads(body)
        except ValueError:
            return ParsedMessage(text, [])
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ParsedMessage(text, [])
        arguments = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(arguments)}})
    content = _CALL.sub("", text).strip()
    return ParsedMessage(content or None, calls)


def parse_tool_calls(parser: str, text: str) -> ParsedMessage:
    if parser != "hermes":
        raise ValueError(f"unknown tool-call parser {parser!r} (known: {', '.join(PARSERS)})")
    return parse_hermes(text)
