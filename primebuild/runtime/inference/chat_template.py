"""A model's own chat template (jinja, from its tokenizer config), rendered token in / token out.

A chat episode is one token sequence: the rendered opening messages, then each model turn exactly as it
was sampled, then the template's rendering of the messages that answer it (a user's reply, tool results)
up to the next generation prompt. The sampled ids are never decoded and rendered again: a template that
re-renders an assistant message (its tool calls re-serialised, its text re-tokenised) would train the
model on tokens it did not sample.

What the template puts after a finished assistant turn is found by rendering a reference exchange with
and without the new messages and keeping the difference; the ids the template writes after the
assistant's end-of-turn token (ChatML's newline after `<|im_end|>`) are the glue in front. This needs the
template to extend a conversation by appending (the rendering of `m + new` starts with that of `m`):
checked on every call, and a template that rewrites earlier turns (e.g. drops past reasoning) is refused.
"""

from __future__ import annotations

from collections.abc import Iterable

_REFERENCE = ({"role": "user", "content": "?"}, {"role": "assistant", "content": "?"})


class TemplateError(ValueError):
    """The template cannot render this exchange token in / token out."""


class ChatTemplate:
    def __init__(self, tokenizer, end_of_turn_ids: Iterable[int] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the model's tokenizer config has no chat_template")
        self.tokenizer = tokenizer
        ids = set(end_of_turn_ids or ()) or {tokenizer.eos_token_id}
        self.end_of_turn_ids = frozenset(i for i in ids if i is not None)

    def render(self, messages: list[dict], *, tools: list[dict] | None = None,
               add_generation_prompt: bool = True) -> list[int]:
        ids = self.tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=True,
                                                 add_generation_prompt=add_generation_prompt, return_dict=False)
        return list(ids)

    def prompt_ids(self, messages: list[dict], *, tools: list[dict] | None = None) -> list[int]:
        """The opening messages (system, user...) and the generation prompt."""
        return self.render(messages, tools=tools)

    def continuation_ids(self, sampled: list[int], messages: list[dict], *,
                         tools: list[dict] | None = None) -> list[int]:
        """The ids that follow a model turn `sampled` (as the engine returned it): the template's close of
        that turn where the engine did not sample it, the new `messages` and the next generation prompt."""
        if not messages:
            raise TemplateError("a continuation needs at least one new message")
        if any(m.get("role") == "assistant" for m in messages):
            raise TemplateError("assistant turns are sampled, not rendered: only user, tool or system messages")
        base = self.render(list(_REFERENCE), tools=tools, add_generation_prompt=False)
        extended = self.render([*_REFERENCE, *messages], tools=tools)
        if extended[:len(base)] != base:
            raise TemplateError("the chat template does not extend a conversation by appending to it, so the "
                                "sampled tokens could not be kept as they are")
        ends = [i for i, token in enumerate(base) if token in self.end_of_turn_ids]
        if not ends:
            raise TemplateError("the chat template closes an assistant turn without an end-of-turn token")
        # The engine stops on the end-of-turn token and includes it; a turn cut short (max_tokens) did not
        # reach it, so the template's close is added as it would have rendered it.
        ended = bool(sampled) and sampled[-1] in self.end_of_turn_ids
        close = base[ends[-1] + 1:] if ended else base[ends[-1]:]
        return close + extended[len(base):]
