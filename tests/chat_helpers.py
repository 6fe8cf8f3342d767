"""A tiny random Qwen3 folder whose tokenizer is the chat tokenizer (ChatML + hermes tool calls)."""

from __future__ import annotations

from pathlib import Path

import torch

from primebuild.runtime.models.chat_tokenizer import END_OF_TEXT, IM_END, VOCAB, save_chat_tokenizer


def save_chat_model(folder: Path, seed: int = 0) -> Path:
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         initializer_range=0.1, eos_token_id=VOCAB.index(IM_END), tie_word_embeddings=False)
    folder.mkdir(parents=True, exist_ok=True)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    GenerationConfig(eos_token_id=[VOCAB.index(IM_END), VOCAB.index(END_OF_TEXT)]).save_pretrained(folder)
    save_chat_tokenizer(folder)
    return folder
