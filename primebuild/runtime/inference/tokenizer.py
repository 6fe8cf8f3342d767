"""The served model's tokenizer: text <-> ids, the chat template, and which ids end a sequence."""

from __future__ import annotations

import json
from pathlib import Path

from primebuild.errors import Problem, UserError


class ServedTokenizer:
    def __init__(self, model_path: str | Path):
        from transformers import AutoTokenizer

        path = Path(model_path)
        if not path.is_dir():
            raise UserError(Problem("model folder does not exist", file=str(path), hint="check --model"))
        try:
            self._tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as err:
            raise UserError(
                Problem(
                    f"cannot load the tokenizer: {err}",
                    file=str(path),
                    hint="save tokenizer.json / tokenizer_config.json beside the weights",
                )
            ) from None
        self.eos_token_ids = sorted(self._eos_ids(path))
        # No token covers more characters than its vocabulary string (vLLM's bound): a text longer than
        # max_model_len * this has too many tokens, known without tokenising it (30 MB took 260 s).
        self.max_chars_per_token = max(len(token) for token in self._tok.get_vocab())

    def _eos_ids(self, path: Path) -> set[int]:
        """EOS ids from generation_config.json, config.json and the tokenizer (real checkpoints differ)."""
        ids: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            file = path / name
            if file.is_file():
                value = json.loads(file.read_text()).get("eos_token_id")
                ids.update(
                    [value] if isinstance(value, int) else [v for v in value or [] if isinstance(v, int)]
                )
        if self._tok.eos_token_id is not None:
            ids.add(self._tok.eos_token_id)
        return ids

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text)["input_ids"])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        ids = self._tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        """Completion text as OpenAI returns it: special tokens left out."""
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token as a string, special tokens included (for log-prob listings)."""
        return self._tok.decode([token_id], skip_special_tokens=False)
