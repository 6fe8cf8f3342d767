"""trainer.lora at plan time: targets checked against the model's modules (located), what the LoRA path
does not cover refused, adapters counted in the trainer's memory (grads and AdamW state for them only)."""

import json

from conftest import MANIFESTS, call_cli


def _manifest(tmp_path, body: str):
    path = tmp_path / "m.yaml"
    path.write_text(f"apiVersion: primebuild/v1\nkind: Experiment\nextends: [{MANIFESTS / 'reverse-text-lora.yaml'}]\n"
                    f"name: m\n{body}")
    return path


def test_a_target_the_model_lacks_is_a_located_error(tmp_path, capsys):
    path = _manifest(tmp_path, "trainer:\n  lora:\n    rank: 4\n    alpha: 8\n    targets: [q_proj, qkv_proj]\n")
    r = call_cli(capsys, "plan", path)
    assert r.code == 2
    assert f"{path}:9:" in r.err and "trainer.lora.targets[1]" in r.err and "'qkv_proj'" in r.err
    assert "q_proj" in r.err.split("hint:")[1]  # the hint names the modules there are


def test_lora_with_broadcast_is_refused_at_the_field(tmp_path, capsys):
    r = call_cli(capsys, "plan", _manifest(tmp_path, "weight_sync:\n  mode: broadcast\n"))
    assert r.code == 2 and "trainer.lora" in r.err and "broadcast" in r.err


def test_memory_counts_adapters_not_a_trainable_base(capsys):
    def trainer_memory(*args):
        r = call_cli(capsys, "plan", *args, "-o", "json")
        assert r.code == 0, r.err
        return json.loads(r.out)["memory"]["trainer"]["breakdown"]

    full = trainer_memory(MANIFESTS / "reverse-text.yaml")
    lora = trainer_memory(MANIFESTS / "reverse-text-lora.yaml")
    # rank 8 on 7 projections of 2 layers (hidden 64 ...): far fewer trained parameters than the model
    assert lora["grads"] < full["grads"] / 5 and lora["optimizer_state"] == 2 * lora["grads"]
    assert lora["params"] > full["params"]  # the frozen base is still held, plus the adapters
