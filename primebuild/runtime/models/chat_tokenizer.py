"""A character-level chat tokenizer with tool-call tokens, saved as a real Hugging Face tokenizer.

The tiny models that play chat and tool-using tasks need what a real chat model carries: turn markers
(ChatML's `<|im_start|>` / `<|im_end|>`), the hermes tool-call markers (`<tool_call>` ... `</tool_call>`,
what vLLM's `--tool-call-parser hermes` looks for) and a jinja chat template in tokenizer_config.json that
renders system prompts, tool signatures, assistant tool calls and tool results. Every consumer reads the
template from the folder with `AutoTokenizer.from_pretrained`, the embedded engine and vLLM alike; nothing
in the runtime knows this tokenizer.

One id per printable ASCII character (and newline) keeps the vocabulary small (~110 ids), so a tiny model
can still learn to spell a JSON tool call; each marker is one token.
"""

from __future__ import annotations

import string
from pathlib import Path

END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
UNK = "<unk>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END, UNK)
# Not special: decoding keeps them, so the text a server parses for tool calls still holds the markers.
TOOL_TOKENS = (TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END)
CHARACTERS = tuple(dict.fromkeys(string.printable[:95] + "\n"))  # letters, digits, punctuation, space, newline
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + TOOL_TOKENS + CHARACTERS

# ChatML turns; with `tools` the system turn lists their JSON signatures and says how to call one. An
# assistant's tool calls are rendered the way the model writes them: <tool_call>{"name", "arguments"}</tool_call>.
# Tool results go back in a `tool` turn, each wrapped in <tool_response>.
CHAT_TEMPLATE = """\
{%- set system = messages[0].content if messages and messages[0].role == 'system' else none -%}
{%- if tools -%}
<|im_start|>system
{% if system %}{{ system }}
{% endif %}Tools:
{% for tool in tools %}{{ (tool.function if tool.function is defined else tool) | tojson }}
{% endfor %}Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% elif system -%}
<|im_start|>system
{{ system }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] -%}
{%- set function = call.function if call.function is defined else call -%}
<tool_call>{"name": {{ function.name | tojson }}, "arguments": \
{{ function.arguments if function.arguments is string else function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>tool
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% elif message.role != 'system' or not loop.first -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""


def build_chat_tokenizer():
    """A `PreTrainedTokenizerFast` over `VOCAB`, `<|im_end|>` ending a turn (imports transformers lazily)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({token: i for i, token in enumerate(VOCAB)}, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    core.add_tokens(list(TOOL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=END_OF_TEXT, unk_token=UNK,
                                   chat_template=CHAT_TEMPLATE, model_max_length=4096)


def save_chat_tokenizer(out_dir: str | Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json (the chat template inside it, as vLLM reads it)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_chat_tokenizer().save_pretrained(out, save_jinja_files=False)
    return out
