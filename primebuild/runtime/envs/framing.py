"""How an environment's prompt and replies become tokens: plain text, or the model's own chat template.

- `TextFraming`: the prompt text encoded with the tokenizer's special tokens, each reply's text without
  them (the environment writes its own separators); what every environment had before chat templates.
- `ChatFraming`, for a `ChatEnvironment`: the opening messages (and the tools the task offers) rendered by
  the model's chat template; each reply is a list of messages (a user's reply, tool results; a bare string
  is a user message) rendered as the template continues a conversation after the sampled turn
  (primebuild/runtime/inference/chat_template.py). The sampled ids stay as they are; only the environment's turns
  are rendered, so the trained sequence holds exactly the tokens the model sampled.

The orchestrator (primebuild/runtime/orchestrator/rollout.py) and greedy evaluation (primebuild/runtime/evaluate.py) frame
episodes through the same object, so SFT evaluation and RL see the same tokens.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from primebuild.errors import UserError
from primebuild.runtime.envs.base import MultiTurnEnvironment, Task
from primebuild.runtime.envs.transcript import encode_prompt, encode_reply

Reply = str | list[dict]  # what `Episode.step` answers: text, or (chat environments) messages


@runtime_checkable
class ChatEnvironment(MultiTurnEnvironment, Protocol):
    def chat_messages(self, task: Task) -> list[dict]:
        """The messages that open an episode (system, user), in OpenAI's shape."""
        ...

    def chat_tools(self, task: Task) -> list[dict] | None:
        """The tools the model may call (OpenAI `tools`), rendered by the template; None: no tools."""
        ...


class TextFraming:
    def __init__(self, env: Any, tokenizer: Any):
        self.env, self.tokenizer = env, tokenizer

    def prompt_ids(self, task: Task) -> list[int]:
        return encode_prompt(self.tokenizer, self.env.format_prompt(task))

    def reply_ids(self, task: Task, sampled: list[int], reply: Reply) -> list[int]:
        if not isinstance(reply, str):
            raise UserError(f"environment {self.env.id}: replied with messages, but it is not a chat environment")
        return encode_reply(self.tokenizer, reply)


class ChatFraming:
    def __init__(self, env: ChatEnvironment, tokenizer: Any, end_of_turn_ids: list[int] | None = None):
        from primebuild.runtime.inference.chat_template import ChatTemplate, TemplateError

        try:
            self.template = ChatTemplate(tokenizer, end_of_turn_ids)
        except TemplateError as e:
            raise UserError(f"environment {env.id} is a chat environment: {e}",
                            hint="use a model whose tokenizer_config.json carries a chat_template") from None
        self.env = env

    def prompt_ids(self, task: Task) -> list[int]:
        return self.template.prompt_ids(self.env.chat_messages(task), tools=self.env.chat_tools(task))

    def reply_ids(self, task: Task, sampled: list[int], reply: Reply) -> list[int]:
        messages = [{"role": "user", "content": reply}] if isinstance(reply, str) else list(reply)
        return self.template.continuation_ids(sampled, messages, tools=self.env.chat_tools(task))


def framing(env: Any, tokenizer: Any, end_of_turn_ids: list[int] | None = None) -> TextFraming | ChatFraming:
    if isinstance(env, ChatEnvironment):
        return ChatFraming(env, tokenizer, end_of_turn_ids)
    return TextFraming(env, tokenizer)
