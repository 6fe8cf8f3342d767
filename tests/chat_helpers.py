"""A tiny random Qwen3 folder whose tokenizer is the chat tokenizer (ChatML + hermes tool calls)."""

from __future__ import annotations

from pathlib import Path

import torch

from primebuild.runtime.models.chat_tokenizer import END_OF_TEXT, IM_END, VOCAB, save_chat_tokenizer

# The tool of the tool-call tests, and the call a taught model answers with (train_tool_caller).
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "the value of a key",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}]
# the same tool as verifiers' MCP toolset server describes it (captured from the null harness's request)
MCP_TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "The value of a key.",
    "parameters": {"type": "object", "properties": {"key": {"title": "Key", "type": "string"}}, "required": ["key"],
                   "title": "lookupArguments"}}}]
CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "ab"}}</tool_call>'


def save_chat_model(folder: Path, seed: int = 0, head_dim: int = 16) -> Path:
    """head_dim 32 for vLLM (its CPU attention has none below 32)."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    heads = 64 // head_dim
    config = Qwen3Config(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=head_dim,
                         max_position_embeddings=1024,
                         initializer_range=0.1, eos_token_id=VOCAB.index(IM_END), tie_word_embeddings=False)
    folder.mkdir(parents=True, exist_ok=True)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    GenerationConfig(eos_token_id=[VOCAB.index(IM_END), VOCAB.index(END_OF_TEXT)]).save_pretrained(folder)
    save_chat_tokenizer(folder)
    return folder


def tool_use_sequence(template, tokenizer, rng, tools: list[dict], call: str, answer: str, system: str | None = None):
    """(ids, loss mask) of one episode: a random user (and maybe system) message, the model's tool call,
    the tool's result, the model's answer; built the way the orchestrator records it (chat_template.py)."""
    def text(n):
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz 0123456789?") for _ in range(n))

    end = tokenizer.convert_tokens_to_ids(IM_END)
    messages = ([{"role": "system", "content": system}] if system is not None else
                [{"role": "system", "content": text(rng.randint(5, 40))}] if rng.random() < 0.5 else [])
    messages.append({"role": "user", "content": text(rng.randint(3, 30))})
    ids = template.prompt_ids(messages, tools=tools)
    mask = [0] * len(ids)
    first = tokenizer.encode(call, add_special_tokens=False) + [end]
    ids, mask = ids + first, mask + [1] * len(first)
    reply = template.continuation_ids(first, [{"role": "tool", "content": text(rng.randint(1, 8))}], tools=tools)
    ids, mask = ids + reply, mask + [0] * len(reply)
    last = tokenizer.encode(answer, add_special_tokens=False) + [end]
    return ids + last, mask + [1] * len(last)


def masked_lm_step(model, optimizer, rows: list[tuple[list[int], list[int]]]):
    """One optimizer step of next-token loss on `rows` (token ids, loss mask), right-padded into one batch;
    returns the loss (mean over the masked-in targets)."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r, _ in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.float32)
    logits = model(input_ids=ids).logits[:, :-1]
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    loss = (losses * mask[:, 1:]).sum() / mask[:, 1:].sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


def train_tool_caller(folder: Path, tools: list[dict], call: str, answer: str, steps: int = 200, seed: int = 0,
                      other_tools: tuple[list[dict], ...] = (), system: str | None = None):
    """Teach the tiny chat model in `folder` (in place) to answer any user with the tool call `call` and any
    tool result with `answer`: a real model that calls a tool, for the tests of the tool-call path.
    `other_tools`: the same tool as other clients describe it (an MCP server's schema adds titles and
    `required`), so the model calls it under those prompts too. `system`: the system prompt every
    episode has (a harness that always sends its own), instead of a random one half the time."""
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primebuild.runtime.inference.chat_template import ChatTemplate

    tokenizer = AutoTokenizer.from_pretrained(folder)
    template = ChatTemplate(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    for _ in range(steps):
        rows = [tool_use_sequence(template, tokenizer, rng, rng.choice([tools, *other_tools]), call, answer,
                                  system)
                for _ in range(6)]
        loss = masked_lm_step(model, optimizer, rows)
    model.save_pretrained(folder)
    return loss.item()
