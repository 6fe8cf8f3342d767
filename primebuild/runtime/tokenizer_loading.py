"""A model folder's tokenizer for the processes that only tokenise (the orchestrator).

`AutoTokenizer` imports transformers' configuration machinery, and with it torch (~220 MiB of a process
that holds no tensor). A folder whose tokenizer is the plain fast tokenizer (`tokenizer.json`, class
`TokenizersBackend` or `PreTrainedTokenizerFast`, as this project's tiny tokenizers save it) loads through
that class directly, which needs the `tokenizers` library and no torch; every other folder keeps
`AutoTokenizer` and whatever class its config names.
"""

from __future__ import annotations

import json
from pathlib import Path

PLAIN_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(folder: str | Path):
    folder = Path(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if config.get("tokenizer_class") in PLAIN_FAST_CLASSES and (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
