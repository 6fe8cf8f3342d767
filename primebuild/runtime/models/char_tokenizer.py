"""A character-level tokenizer for the embedded default, saved as a real Hugging Face tokenizer.

One id per character keeps the reverse-text task honest (the model must move single letters, not
sub-words) and the vocabulary tiny (32 ids, so the embedding is a rounding error of the 0.5M
parameters). Building it with the `tokenizers` library and saving it through `PreTrainedTokenizerFast`
means every consumer (inference server, trainer, evaluation) loads it with the ordinary
`AutoTokenizer.from_pretrained(folder)`; nothing in the runtime special-cases it.

Encoding adds `<bos>` in front (the post-processor), never `<eos>`: a prompt is a prefix the model
continues, and the model ends its own completion with `<eos>`.
"""

from __future__ import annotations

import string
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
LETTERS = tuple(string.ascii_lowercase)
SEPARATOR = ">"  # ends a prompt: "abc>" asks for the continuation "cba"
SPACE = " "  # lets a user or system message hold words; the reverse-text task never uses it

# Order fixes the ids: pad=0, bos=1, eos=2, unk=3, a..z=4..29, ">"=30, " "=31.
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + LETTERS + (SEPARATOR, SPACE)

# A chat is rendered as: <bos>, then each user turn followed by the separator, each assistant turn
# followed by <eos>. So a one-turn chat with a generation prompt is exactly "<bos>" + prompt + ">",
# the same ids the reverse-text environment's plain prompt encodes to.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ message['content'] }}" + SEPARATOR + "{% endif %}"
    "{% endfor %}"
)


def build_char_tokenizer():
    """A `PreTrainedTokenizerFast` over `VOCAB` (imports transformers lazily: it is heavy)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own "word"; "isolated" keeps spaces as tokens instead of dropping them.
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    core.decoder = decoders.Fuse()  # concatenate characters back without separators
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",  # generation pads on the left; training code pads explicitly
        chat_template=CHAT_TEMPLATE,
        model_max_length=128,
    )


def save_char_tokenizer(out_dir: str | Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json (chat template included) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # The chat template goes inside tokenizer_config.json (not a separate .jinja file): every
    # consumer, old transformers and vLLM included, reads it there.
    build_char_tokenizer().save_pretrained(out, save_jinja_files=False)
    return out
