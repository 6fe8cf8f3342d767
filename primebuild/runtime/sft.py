"""The SFT store build: the RL trainer's SFT (primebuild/runtime/trainer/sft.py) run for a manifest's `sft:`
section, on `ranks` torchrun ranks on this host, or in this process for one CPU rank.

- A chat dataset (ChatSFTConfig): assistant-only NLL; at the end, with an environment, the finished
  model's greedy held-out reward.
- An environment's demonstrations (EnvSFTConfig, trainer/env_sft.py): the embedded default's first stage,
  which brings a random-init model to a reward where RL has signal (calibration.md: ~0.75-0.85 on
  reverse-text; RL from 0.57 collapsed, from ~1.0 it has nothing to add). By default it stops as soon as
  a greedy validation reward on fixed training-side tasks reaches `RL_START_REWARD`
  (primebuild/contracts/sft.py says why a fixed step count cannot).

The one-process HF loop that trained the environment SFTs before is retired: the trainer's env SFT keeps
its framing, loss mask, optimiser (AdamW, linear warm-up, global-norm clip 1.0), validation tasks and
stop, and lands in the same band (docs/training.md).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from primebuild.contracts.sft import ChatSFTConfig, EnvSFTConfig
from primebuild.errors import UserError


def run_trainer_sft(config: ChatSFTConfig | EnvSFTConfig, out_dir: str, echo=print) -> dict:
    """SFT on the RL trainer (primebuild/runtime/trainer/sft.py), `config.ranks` torchrun ranks on this
    host: of a chat dataset (then, with an environment, the finished model's greedy held-out reward), or
    of an environment's demonstrations (EnvSFTConfig: the ranks evaluate and stop early themselves).
    A dataset is read and checked here first: a bad row is a located error before any rank starts."""
    import subprocess
    import tempfile

    from primebuild.builders.chat_dataset import read_chats

    if Path(out_dir).exists():
        raise UserError(f"{out_dir}: output folder already exists", hint="choose a new folder")
    if isinstance(config, ChatSFTConfig):
        read_chats(config.dataset_path)
    elif config.ranks == 1 and config.device == "cpu":
        return _env_sft_in_process(config, out_dir, echo)
    with tempfile.TemporaryDirectory(prefix="primebuild-sft-") as tmp:
        config_file, metrics_file = Path(tmp) / "sft.json", Path(tmp) / "metrics.json"
        config_file.write_text(config.model_dump_json())
        command = [sys.executable, "-m", "primebuild.runtime.trainer.launch", "--nnodes", "1", "--node-rank", "0",
                   "--master-addr", "127.0.0.1", "--master-port", "0", "--bind", "127.0.0.1", "--",
                   "--nproc-per-node", str(config.ranks), "-m", "primebuild.runtime.trainer.sft",
                   "--config", str(config_file), "--out", str(out_dir), "--metrics", str(metrics_file)]
        env = {**os.environ, "OMP_NUM_THREADS": str(config.num_threads)}
        if config.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # init_distributed picks CUDA whenever it sees a GPU
        lines = []
        with subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) as ranks:
            for line in ranks.stderr:
                lines.append(line)
                if _progress_line(line):  # "sft ...": never read as one of the RL run's step lines
                    echo("sft " + line.rstrip().split("] ", 1)[-1])
        if ranks.returncode != 0:
            errors = [line for line in lines if line.startswith("error:")]
            if errors:  # a rank's UserError (exit 2): shown as ours
                raise UserError(errors[0].removeprefix("error: ").strip())
            raise RuntimeError(f"SFT trainer ranks failed (exit {ranks.returncode}):\n{''.join(lines)[-4000:]}")
        metrics = json.loads(metrics_file.read_text())
    if isinstance(config, ChatSFTConfig) and config.env_id and config.eval_n:
        import torch

        from primebuild.runtime.envs.registry import load_environment
        from primebuild.runtime.evaluate import evaluate_tasks, load_hf_folder

        torch.set_num_threads(config.num_threads)
        environment = load_environment(config.env_id, config.env_version, config.env_args)
        model, tokenizer = load_hf_folder(out_dir)
        max_new_tokens = getattr(environment, "max_tokens_per_turn", 16)
        metrics["eval_reward"] = evaluate_tasks(model, tokenizer, environment, environment.eval_tasks()[: config.eval_n],
                                                max_new_tokens=max_new_tokens)
    return metrics


def _env_sft_in_process(config: EnvSFTConfig, out_dir: str, echo) -> dict:
    """One CPU rank needs no torchrun: the same trainer code in this process (as the old loop ran), which
    spares the store build a launcher and a second interpreter's imports (~10-30 s on CI's 2 cores)."""
    import logging

    import torch

    from primebuild.runtime.trainer.env_sft import train_env_sft
    from primebuild.runtime.trainer.model import DistEnv

    class Progress(logging.Handler):
        def emit(self, record):
            line = f"[sft rank 0] {record.getMessage()}"
            if _progress_line(line):
                echo("sft " + record.getMessage())

    log, handler = logging.getLogger("primebuild.sft"), Progress()
    log.addHandler(handler)
    level, log.level = log.level, logging.INFO
    threads = torch.get_num_threads()
    torch.set_num_threads(config.num_threads)
    try:
        return train_env_sft(config, Path(out_dir), DistEnv(rank=0, world_size=1, device=torch.device("cpu")))
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        torch.set_num_threads(threads)


_RANK0_STEP = re.compile(r"\[sft rank 0\] step (\d+) (held-out |validation )?")


def _progress_line(line: str) -> bool:
    """Rank 0's lines worth showing while the store builds: step 1, every 100th, each held-out or validation
    score."""
    match = _RANK0_STEP.search(line)
    return bool(match) and (match.group(2) is not None or int(match.group(1)) % 100 == 0 or match.group(1) == "1")
