"""Tool lookup: answer the value of a key that only a tool knows (a chat environment with one tool).

Made for a tiny chat-templated model (primebuild/runtime/models/chat_tokenizer.py): each task hides a table row
`key -> value` drawn at random per task, so no model can know the value; the only way to it is the
`lookup` tool. An episode, in the model's own chat template (envs/framing.py renders every turn):

    system: the `lookup` tool's signature        user: the key
    assistant: <tool_call>{"name": "lookup", "arguments": {"key": KEY}}</tool_call>
    tool: <tool_response>VALUE</tool_response>   assistant: VALUE

A model turn with a hermes tool call gets the tool's result (the value for the task's key, `unknown`
for any other key); a turn without one is the answer and ends the episode. Reward 1 when the answer is
the value, else 0 (guessing it blind succeeds once in len(alphabet) ** value_length).

Held-out split: a row is held out iff CRC32("key:value") % EVAL_BUCKETS == 0; training never draws one.
`key_length: 0` is the easiest variant: one empty key, the call is always the same, and the model has
only to answer the value the tool returned.
"""

from __future__ import annotations

import itertools
import json
import random
import zlib

from primebuild.errors import UserError
from primebuild.runtime.envs.base import ENVIRONMENT, MODEL, Task
from primebuild.runtime.inference.tool_parser import parse_tool_calls

ENV_ID = "tool-lookup"
ENV_VERSION = "1"
EVAL_BUCKETS = 5
EVAL_SEED = 7_654_321  # which held-out rows are the eval tasks: fixed, so every eval sees the same
UNKNOWN = "unknown"
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "value of key",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}]


def is_eval_row(key: str, value: str) -> bool:
    return zlib.crc32(f"{key}:{value}".encode()) % EVAL_BUCKETS == 0


def _task(key: str, value: str) -> Task:
    return Task(prompt=key or "value?", answer=value, info={"key": key})


def tool_call(key: str) -> str:
    """The model turn that looks `key` up, as the hermes parser reads it."""
    return f'<tool_call>{{"name": "lookup", "arguments": {json.dumps({"key": key})}}}</tool_call>'


def called_keys(text: str) -> list[str] | None:
    """The keys of the `lookup` calls in a model turn; None when the turn calls no tool (an answer)."""
    calls = parse_tool_calls("hermes", text).tool_calls
    if not calls:
        return None
    keys = []
    for call in calls:
        arguments = json.loads(call["function"]["arguments"])
        keys.append(str(arguments.get("key", "")) if call["function"]["name"] == "lookup" else "")
    return keys


class LookupEpisode:
    def __init__(self, task: Task, max_turns: int):
        self.task, self.turns_left = task, max_turns
        self.answer: str | None = None

    async def step(self, completion: str) -> list[dict] | None:
        self.turns_left -= 1
        keys = called_keys(completion)
        if keys is None:
            self.answer = completion.strip()
            return None
        if self.turns_left <= 0:
            return None
        return [{"role": "tool", "content": self.task.answer if key == self.task.info["key"] else UNKNOWN}
                for key in keys]

    async def reward(self) -> float:
        return float(self.answer == self.task.answer)

    async def close(self) -> None:
        pass


class ToolLookupEnv:
    id = ENV_ID
    version = ENV_VERSION

    def __init__(self, key_length: int = 2, value_length: int = 2, alphabet: str = "abcdefghijklmnop", max_turns: int = 3,
                 num_eval: int = 48, max_tokens_per_turn: int = 64):
        if len(set(alphabet)) != len(alphabet) or not alphabet.isalpha():
            raise UserError(f"environment {ENV_ID}: alphabet {alphabet!r} must be distinct letters")
        rows = [("".join(k), "".join(v)) for k in itertools.product(alphabet, repeat=key_length)
                for v in itertools.product(alphabet, repeat=value_length)]
        held_out = [row for row in rows if is_eval_row(*row)]
        if len(held_out) < num_eval or len(held_out) == len(rows):
            raise UserError(f"environment {ENV_ID}: {len(held_out)} held-out rows, {num_eval} asked",
                            hint="raise key_length, value_length or the alphabet, or lower num_eval")
        self.alphabet, self.key_length, self.value_length = alphabet, key_length, value_length
        self.max_turns, self.max_tokens_per_turn = max_turns, max_tokens_per_turn
        self._eval = [_task(*row) for row in random.Random(EVAL_SEED).sample(held_out, num_eval)]

    def sample_tasks(self, rng: random.Random, n: int) -> list[Task]:
        tasks = []
        while len(tasks) < n:
            key, value = self._word(rng, self.key_length), self._word(rng, self.value_length)
            if not is_eval_row(key, value):
                tasks.append(_task(key, value))
        return tasks

    def _word(self, rng: random.Random, length: int) -> str:
        return "".join(rng.choice(self.alphabet) for _ in range(length))

    def eval_tasks(self) -> list[Task]:
        return list(self._eval)

    # a chat environment (envs/framing.py): the template renders these, not format_prompt
    def chat_messages(self, task: Task) -> list[dict]:
        return [{"role": "user", "content": task.prompt}]

    def chat_tools(self, task: Task) -> list[dict]:
        return TOOLS

    def format_prompt(self, task: Task) -> str:
        return task.prompt

    def score(self, task: Task, completion: str) -> float:
        return float(completion.strip() == task.answer)

    def start(self, task: Task) -> LookupEpisode:
        return LookupEpisode(task, self.max_turns)

    def demonstration(self, task: Task, rng: random.Random) -> list[tuple[bool, str | list[dict]]]:
        return [(MODEL, tool_call(task.info["key"])), (ENVIRONMENT, [{"role": "tool", "content": task.answer}]),
                (MODEL, task.answer)]
