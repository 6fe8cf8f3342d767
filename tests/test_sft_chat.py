"""SFT of chat datasets on the RL trainer (primebuild/runtime/trainer/sft.py): the assistant-only mask, bad
rows located before anything runs, 1 rank vs 2 gloo ranks (FSDP2) on the same loss trajectory."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from primebuild.builders.chat_dataset import read_chats  # noqa: E402
from primebuild.contracts.sft import ChatSFTConfig  # noqa: E402
from primebuild.errors import UserError  # noqa: E402
from primebuild.runtime.models.chat_tokenizer import build_chat_tokenizer  # noqa: E402
from primebuild.runtime.sft import run_trainer_sft  # noqa: E402
from primebuild.runtime.trainer.sft import encode_chat  # noqa: E402

TWO_TURNS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "ab"}, {"role": "user", "content": "again"},
             {"role": "assistant", "content": "cd"}]


def chat_model(path, seed: int = 0):
    """A random tiny Qwen3 over the chat tokenizer (tool-use-tiny's architecture, 1 layer: fast)."""
    from primebuild.runtime.models.tiny import init_tiny_model, save_hf_folder, tiny_config

    tokenizer = build_chat_tokenizer()
    config = tiny_config(hidden_size=64, num_layers=1, intermediate_size=128)
    config.update({"vocab_size": len(tokenizer), "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
                   "pad_token_id": tokenizer.pad_token_id})
    save_hf_folder(init_tiny_model(config, seed), tokenizer, path)
    return path


def write_jsonl(path, rows) -> str:
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_mask_covers_assistant_turns_and_their_end_of_turn_only():
    tok = build_chat_tokenizer()
    ids, mask = encode_chat(tok, TWO_TURNS)
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == "ab<|im_end|>cd<|im_end|>"
    # every trained token sits inside an assistant turn: the framing and the user's words are given
    given = tok.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert "hi" in given and "again" in given and "be brief" in given and "ab" not in given
    assert len(ids) == len(mask) and sum(mask) == len(tok("ab<|im_end|>cd<|im_end|>", add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("line, why", [
    ('{"messages": []}', "`messages` is not a non-empty list"),
    ('{"text": "hello"}', "no `messages` field (fields: text)"),
    ('{"messages": [{"role": "user", "content": "q"}]}', "no assistant message"),
    ('{"messages": [{"role": "bot", "content": "q"}]}', "messages[0].role is 'bot'"),
    ('{"messages": [{"role": "assistant", "content": 3}]}', "messages[0].content is int"),
    ('{"messages": [', "not JSON"),
])
def test_a_bad_row_is_named_by_file_and_line(tmp_path, line, why):
    good = json.dumps({"messages": TWO_TURNS})
    path = write_jsonl(tmp_path / "d.jsonl", [good + "\n", "\n", line + "\n"])
    with pytest.raises(UserError) as err:
        read_chats(path)
    assert f"{path}:3: line 3 is not a chat: {why}" in str(err.value)


def test_a_bad_parquet_row_is_named_by_its_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"messages": [TWO_TURNS, [{"role": "user", "content": "q"}]]}), path)
    with pytest.raises(UserError, match=r"row 2 is not a chat: no assistant message"):
        read_chats(path)
    pq.write_table(pa.table({"messages": [TWO_TURNS]}), path)
    assert read_chats(path)[0]["messages"] == TWO_TURNS


def reversal_rows(n: int) -> list[dict]:
    """Chats of several lengths: reverse a word, twice in some rows (two assistant turns)."""
    words = ["abc", "hello", "kite", "mn", "river", "stone", "xy", "quartz"]
    rows = []
    for i in range(n):
        w = words[i % len(words)]
        messages = [{"role": "user", "content": w}, {"role": "assistant", "content": w[::-1]}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": w + w}, {"role": "assistant", "content": (w + w)[::-1]}]
        rows.append({"messages": messages})
    return rows


def test_one_rank_and_two_fsdp_ranks_follow_the_same_loss_trajectory(tmp_path):
    model = chat_model(tmp_path / "base")
    data = write_jsonl(tmp_path / "d.jsonl", reversal_rows(40))
    common = dict(model_path=str(model), dataset_path=data, steps=4, batch_size=8, lr=3e-3,
                  micro_batch_tokens=96, eval_rows=8, eval_every=2)
    one = run_trainer_sft(ChatSFTConfig(ranks=1, **common), str(tmp_path / "one"))
    two = run_trainer_sft(ChatSFTConfig(ranks=2, **common), str(tmp_path / "two"))
    assert one["ranks"] == 1 and two["ranks"] == 2
    assert one["loss_curve"] == pytest.approx(two["loss_curve"], rel=1e-5)
    assert [s for s, _ in one["eval_loss_curve"]] == [2, 4]
    assert [v for _, v in one["eval_loss_curve"]] == pytest.approx([v for _, v in two["eval_loss_curve"]], rel=1e-5)
    assert one["loss_curve"][-1] < one["loss_curve"][0]  # it learns
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)


def test_a_bad_row_stops_the_run_before_any_rank_starts(tmp_path):
    model = chat_model(tmp_path / "base")
    data = write_jsonl(tmp_path / "d.jsonl", reversal_rows(3) + ['{"messages": "hi"}'])
    with pytest.raises(UserError, match=r"d.jsonl:4: line 4 is not a chat"):
        run_trainer_sft(ChatSFTConfig(model_path=str(model), dataset_path=data), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_chat_sft_builds_into_the_store_and_an_rl_manifest_starts_from_it(tmp_path):
    """The shipped tool-use-chat-sft.yaml (shortened) plans with its ranks' memory, builds on 2 gloo ranks
    into the store, and tool-use.yaml, pointed at it, plans and runs a step from that entry."""
    from conftest import free_port, plan_json, run_cli, sft_workspace

    root = tmp_path / "ws"
    manifests = sft_workspace(root, ("tool-use.yaml",), sft="tool-use-chat-sft.yaml",
                              sft_changes={"steps": 12, "warmup_steps": 2, "eval_every": 4})
    plan = plan_json(manifests / "tool-use-chat-sft.yaml", design=False)
    assert plan["build"]["builder"] == "sft-chat/1" and plan["build"]["config"]["ranks"] == 2
    assert plan["memory"]["sft-trainer"]["breakdown"]["optimizer_state"] > 0
    rl = ("--set", "model.from_manifest=tool-use-chat-sft.yaml")
    assert run_cli("plan", manifests / "tool-use.yaml", *rl).code == 0
    env = {"PRIMEBUILD_STORE": str(root / "store")}
    result = run_cli("run", manifests / "tool-use.yaml", *rl, "--set", "orchestrator.max_steps=1",
                     "--set", "orchestrator.rollouts_per_step=16", "--set", "orchestrator.eval_every=0",
                     "--set", f"inference.port={free_port()}", "--runs-dir", root / "runs", timeout=900, env=env)
    assert result.code == 0, result.text
    (entry,) = [p for p in (root / "store").iterdir() if p.name.endswith("-tool-use-chat-sft")]
    metrics = json.loads((entry / "sft_metrics.json").read_text())
    assert metrics["trainer"] == "torchtitan" and metrics["ranks"] == 2 and metrics["steps"] == 12
    assert [s for s, _ in metrics["eval_loss_curve"]] == [4, 8, 12]
    assert metrics["eval_loss_curve"][-1][1] < metrics["eval_loss_curve"][0][1]
    assert 0.0 <= metrics["eval_reward"] <= 1.0
    (summary,) = (root / "runs").glob("*/metrics.jsonl")
    assert summary.read_text().strip()  # the RL trainer ran its step from the SFT'd weights


def test_plan_names_a_bad_dataset_row_and_exits_2(tmp_path):
    from conftest import run_cli, sft_workspace

    manifests = sft_workspace(tmp_path / "ws", (), sft="tool-use-chat-sft.yaml", sft_changes=None)
    data = manifests / "data" / "tool-use-chat.jsonl"
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[:4]) + '{"messages": [{"role": "user", "content": "q"}]}\n' + "".join(lines[4:]))
    for command in ("plan", "run"):
        result = run_cli(command, manifests / "tool-use-chat-sft.yaml", timeout=120,
                         env={"PRIMEBUILD_STORE": str(tmp_path / "store")})
        assert result.code == 2 and "Traceback" not in result.err, result.text
        assert f"{data}:5: line 5 is not a chat: no assistant message" in result.err
    assert not any((tmp_path / "store").glob("*-tool-use-chat-sft"))  # nothing was built
