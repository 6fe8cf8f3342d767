"""Tiny random Qwen3 / Qwen3-MoE model folders, a char-level tokenizer and a real uvicorn server.

The folders look exactly like real checkpoints (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template, generation_config.json), so the engine loads them through
the same code path as a downloaded model.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import torch
from conftest import free_port

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz") + [" ", "\n"]
VOCAB = SPECIALS + CHARS  # 32 ids
EOS_ID = VOCAB.index("<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tokenizer(folder: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def _common(seed: int) -> dict:
    return dict(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.1,  # peakier logits than the default: a stricter greedy comparison
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )


def save_model(folder: Path, kind: str = "dense", seed: int = 0, with_tokenizer: bool = True) -> Path:
    """Write a tiny random model folder; the same (kind, seed) always gives the same weights."""
    from transformers import (
        GenerationConfig,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    if kind == "dense":
        model = Qwen3ForCausalLM(Qwen3Config(**_common(seed)))
    elif kind == "moe":
        config = Qwen3MoeConfig(
            **_common(seed),
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],  # one sparse and one dense layer: both paths are exercised
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        raise ValueError(kind)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    GenerationConfig(eos_token_id=[EOS_ID, VOCAB.index("<|endoftext|>")]).save_pretrained(folder)
    if with_tokenizer:
        save_tokenizer(folder)
    return folder


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    return model


def teacher_forced_logprobs(
    model, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0
):
    """Log-prob of each completion token under the HF model (reference for the engine's log-probs)."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    start = len(prompt_ids) - 1
    step_logits = logits[start : start + len(completion_ids)] / (temperature or 1.0)
    logprobs = torch.log_softmax(step_logits, dim=-1)
    return logprobs.gather(1, torch.tensor(completion_ids)[:, None]).squeeze(1).tolist()


@contextlib.contextmanager
def running_server(app, timeout: float = 30.0):
    """Serve `app` with a real uvicorn on 127.0.0.1:<free port> in a thread; yields the base URL."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)


ADMIN_TOKEN = "test-admin-token"


class Served:
    """An engine + app on a real uvicorn server; `url` is the base, `v1` the OpenAI base URL."""

    def __init__(self, url: str, engine):
        self.url = url
        self.v1 = url + "/v1"
        self.engine = engine

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.v1, api_key="unused", max_retries=0, **kwargs)

    def admin(self, path: str, body: dict | None = None, token: str | None = ADMIN_TOKEN):
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60)


@contextlib.contextmanager
def serve_folder(folder: Path, name: str = "tiny", **engine_kwargs):
    """Engine over `folder`, served as model `name`, admin token ADMIN_TOKEN; shut down on exit."""
    from primebuild.runtime.inference.engine import Engine
    from primebuild.runtime.inference.server import create_app
    from primebuild.runtime.inference.tokenizer import ServedTokenizer

    tokenizer = ServedTokenizer(folder)
    engine_kwargs.setdefault("max_num_seqs", 64)
    engine_kwargs.setdefault("max_model_len", 512)
    engine = Engine(
        folder,
        device="cpu",
        eos_token_ids=tokenizer.eos_token_ids,
        detokenize=tokenizer.decode,
        **engine_kwargs,
    )
    app = create_app(engine, tokenizer, served_model_name=name, admin_token=ADMIN_TOKEN)
    try:
        with running_server(app) as url:
            yield Served(url, engine)
    finally:
        engine.shutdown()


def hf_greedy(model, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of exactly `new_tokens` tokens (EOS ignored): the reference."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()
