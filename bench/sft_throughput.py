"""SFT on the RL trainer (primebuild/runtime/trainer/sft.py): steps/s and packed tokens/s, 1 vs 2 ranks.

The shipped chat dataset (manifests/data/tool-use-chat.jsonl) on tool-use-tiny's architecture (random init,
chat tokenizer), the recipe of manifests/tool-use-chat-sft.yaml (16 chats a step, rows of 2048 packed
tokens, fp32, one thread per rank), `--steps` steps, each rank count in its own torchrun launch. Seconds
are the trainer's own wall time from its first to its last step (model load and the HF write excluded);
both rank counts must agree on the loss trajectory (rel 1e-5), which is checked here too.

    PYTHONPATH=$PWD .venv/bin/python bench/sft_throughput.py [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from primebuild.contracts.sft import ChatSFTConfig
from primebuild.runtime.models.chat_tokenizer import build_chat_tokenizer
from primebuild.runtime.models.tiny import init_tiny_model, save_hf_folder, tiny_config_from_facts
from primebuild.runtime.sft import run_trainer_sft

ROOT = Path(__file__).resolve().parent.parent


def chat_model(path: Path) -> Path:
    facts = json.loads((ROOT / "manifests" / "models" / "tool-use-tiny.json").read_text())
    tokenizer = build_chat_tokenizer()
    config = tiny_config_from_facts({k: v for k, v in facts.items() if not k.startswith("_")})
    config.update({"vocab_size": len(tokenizer), "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
                   "pad_token_id": tokenizer.pad_token_id})
    save_hf_folder(init_tiny_model(config, 0), tokenizer, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = chat_model(Path(tmp) / "base")
        runs = {}
        for ranks in (1, 2):
            config = ChatSFTConfig(model_path=str(model), dataset_path=str(ROOT / "manifests/data/tool-use-chat.jsonl"),
                                   steps=args.steps, batch_size=16, lr=2e-3, warmup_steps=5, micro_batch_tokens=2048,
                                   ranks=ranks)
            runs[ranks] = run_trainer_sft(config, str(Path(tmp) / f"out-{ranks}"), echo=lambda _: None)
    one, two = runs[1]["loss_curve"], runs[2]["loss_curve"]
    worst = max(abs(a - b) / abs(a) for a, b in zip(one, two, strict=True))
    print(f"{args.steps} steps, 16 chats/step, micro_batch_tokens 2048; loss 1 vs 2 ranks: max rel diff {worst:.2e}")
    print("| ranks | steps/s | packed tokens/s | assistant tokens/s | final loss |")
    print("|---|---|---|---|---|")
    for ranks, m in runs.items():
        print(f"| {ranks} | {m['steps_per_s']:.2f} | {m['packed_tokens_per_s']:.0f} | {m['assistant_tokens_per_s']:.0f} "
              f"| {m['final_loss']:.4f} |")


if __name__ == "__main__":
    main()
