"""The tiny Qwen3 and its character tokenizer, loaded the way every consumer loads them."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from primebuild.errors import UserError  # noqa: E402
from primebuild.runtime.envs.reverse_text import ReverseTextEnv  # noqa: E402
from primebuild.runtime.models.char_tokenizer import VOCAB, save_char_tokenizer  # noqa: E402
from primebuild.runtime.models.tiny import build_tiny_model  # noqa: E402

FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = save_char_tokenizer(tmp_path_factory.mktemp("tok"))
    return AutoTokenizer.from_pretrained(folder)


def test_vocabulary_and_special_ids(tokenizer):
    assert len(tokenizer) == len(VOCAB) == 32
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.unk_token_id == 3
    assert tokenizer.convert_ids_to_tokens(list(range(4, 8))) == ["a", "b", "c", "d"]


def test_round_trips_every_training_and_eval_string(tokenizer):
    env = ReverseTextEnv()
    tasks = env.sample_tasks(random.Random(0), 2000) + env.eval_tasks()
    texts = [t.prompt for t in tasks] + [t.answer for t in tasks] + [env.format_prompt(t) for t in tasks]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert len(ids) == len(text) + 1  # one id per character, after <bos>
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert tokenizer.decode(tokenizer("two words")["input_ids"], skip_special_tokens=True) == "two words"


def test_unknown_characters_map_to_unk(tokenizer):
    assert tokenizer("aB!", add_special_tokens=False)["input_ids"] == [4, 3, 3]


def test_chat_template_renders_the_environment_prompt(tokenizer):
    env = ReverseTextEnv()
    task = env.eval_tasks()[0]
    chat_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": task.prompt}], add_generation_prompt=True, tokenize=True
    )
    if not isinstance(chat_ids, list):  # transformers 5 returns a BatchEncoding
        chat_ids = chat_ids["input_ids"]
    assert chat_ids == tokenizer(env.format_prompt(task))["input_ids"]
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}], tokenize=False
    )
    assert full == "<bos>abc>cba<eos>"


def test_left_padding_is_the_default(tokenizer):
    batch = tokenizer(["ab>", "abcd>"], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0]
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1]


def test_model_folder_loads_with_auto_classes(tmp_path):
    folder = build_tiny_model(tmp_path / "tiny", seed=0)
    assert FILES <= {p.name for p in folder.iterdir()}
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no staging folder left behind
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    n_params = sum(p.numel() for p in model.parameters())
    assert 400_000 < n_params < 700_000  # calibration.md: 0.53M
    assert model.config.vocab_size == len(tokenizer) == 32
    assert model.config.eos_token_id == tokenizer.eos_token_id
    ids = tokenizer(["abc>"], return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 5, 32) and torch.isfinite(logits).all()


def test_same_seed_gives_identical_bytes(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=7)
    b = build_tiny_model(tmp_path / "b", seed=7)
    c = build_tiny_model(tmp_path / "c", seed=8)
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_building_leaves_the_callers_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_shape_arguments_and_their_validation(tmp_path):
    folder = build_tiny_model(
        tmp_path / "gqa", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=128
    )
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert (model.config.num_key_value_heads, model.config.head_dim) == (2, 16)
    with pytest.raises(UserError, match="num_heads"):
        build_tiny_model(tmp_path / "bad", hidden_size=100, num_heads=3)


def test_existing_output_folder_is_refused(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(UserError, match="already exists"):
        build_tiny_model(tmp_path / "taken")
