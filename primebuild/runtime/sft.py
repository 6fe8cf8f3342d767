"""Supervised fine-tuning of the tiny model on an environment's demonstrations (`task.answer`).

The embedded default's first stage: it brings a random-init model to a reward where RL has signal
(calibration.md: ~0.75-0.85 on reverse-text; RL from 0.57 collapsed, from ~1.0 it has nothing to add).

By default training stops as soon as a validation reward on fixed training-side tasks reaches
`RL_START_REWARD` (primebuild/contracts/sft.py says why a fixed step count cannot); `--no-early-stop`
trains exactly `steps` steps.

One training sequence is `<bos> prompt completion <eos>`; the loss is the mean cross-entropy over the
completion tokens and the `<eos>` only (the prompt is given, not learned). A chat environment's episodes
are framed by the model's chat template (envs/framing.py), exactly as the orchestrator frames them. A multi-turn environment's
demonstration is a whole episode: model turns (each ending in `<eos>`) are learned, the environment's
replies between them are given. Optimiser and schedule are
the calibrated ones: AdamW lr 1e-3, linear warmup over 50 steps then constant, batch 64, gradient
norm clipped at 1.0. Same config and seed -> same weights, bit for bit (CPU, fixed thread count).

    python -m primebuild.runtime.sft --out DIR [--config SFTConfig.json] [--no-early-stop]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

from primebuild.contracts.base import load_contract
from primebuild.contracts.sft import ChatSFTConfig, EnvSFTConfig, SFTConfig
from primebuild.errors import UserError

VALIDATION_SEED = 1_000_003  # validation tasks come from their own RNG: training data stay the same


def encode_batch(tokenizer, prompts: list[str], demonstrations: list[list[tuple[bool, str]]]):
    """(input_ids, loss_mask) of text episodes, right-padded: loss_mask[i, t] says token t+1 of row i is
    a target. The prompt is encoded with the tokenizer's special tokens, each environment segment as the
    orchestrator appends it (primebuild/runtime/envs/transcript.py)."""
    from primebuild.runtime.envs.transcript import encode_prompt, encode_reply

    rows = [episode_ids(tokenizer, encode_prompt(tokenizer, prompt), segments,
                        lambda sampled, text: encode_reply(tokenizer, text))
            for prompt, segments in zip(prompts, demonstrations, strict=True)]
    return pad_batch(tokenizer, rows)


def episode_ids(tokenizer, prompt_ids: list[int], segments, reply_ids) -> tuple[list[int], list[int]]:
    """(ids, mask) of one demonstration (primebuild/runtime/envs/base.py `demonstration`) after its prompt: each
    model turn is encoded and followed by `<eos>` (the engines stop a turn there) and is a target; each
    environment segment is `reply_ids(previous model turn's ids, segment)`, as the orchestrator frames it
    (envs/framing.py: plain text, or the chat template's rendering of messages), and is not."""
    from primebuild.runtime.envs.transcript import encode_reply

    row, mask, sampled = list(prompt_ids), [0] * len(prompt_ids), []
    for by_model, segment in segments:
        if by_model:
            ids = sampled = encode_reply(tokenizer, segment) + [tokenizer.eos_token_id]
        else:
            ids = reply_ids(sampled, segment)
        row += ids
        mask += [int(by_model)] * len(ids)
    return row, mask


def pad_batch(tokenizer, rows: list[tuple[list[int], list[int]]]):
    """Right-pad (ids, mask) rows; the mask shifted: the logits at position t predict token t+1."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    target = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (row, mask) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        target[i, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
    return ids, target[:, 1:]


def completion_loss(model, ids, loss_mask):
    """Mean next-token cross-entropy over the masked (completion) positions.

    No attention mask: padding sits only at the right end, and causal attention never lets a real
    token see what comes after it.
    """
    import torch.nn.functional as F

    logits = model(input_ids=ids).logits[:, :-1]
    losses = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return (losses * loss_mask).sum() / loss_mask.sum()


def run_sft(config: SFTConfig, out_dir: str) -> dict:
    """Train, evaluate, write the HF folder to `out_dir` (which must not exist); return the metrics."""
    import torch

    from primebuild.runtime.envs.base import demonstration
    from primebuild.runtime.envs.framing import framing
    from primebuild.runtime.envs.registry import load_environment
    from primebuild.runtime.evaluate import evaluate_tasks, load_hf_folder
    from primebuild.runtime.models.char_tokenizer import build_char_tokenizer
    from primebuild.runtime.models.tiny import init_tiny_model, save_hf_folder, tiny_config

    if Path(out_dir).exists():
        raise UserError(f"{out_dir}: output folder already exists", hint="choose a new folder")

    started = time.perf_counter()
    torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    env = load_environment(config.env_id, config.env_version, config.env_args)
    rng = random.Random(config.seed)
    if config.init_model_dir:
        model, tokenizer = load_hf_folder(config.init_model_dir)
    else:
        model, tokenizer = init_tiny_model(tiny_config(), config.seed), build_char_tokenizer()
    model.train()
    framed = framing(env, tokenizer)  # plain text, or the model's chat template, as the orchestrator frames

    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup = max(config.warmup_steps, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))

    validation = (
        env.sample_tasks(random.Random(VALIDATION_SEED), config.validation_n)
        if config.stop_at_reward is not None
        else []
    )

    # an environment whose turns are longer than the default (swe-tiny's commands) says how long
    max_new_tokens = getattr(env, "max_tokens_per_turn", config.eval_max_new_tokens)

    def greedy_reward(tasks):
        # Greedy decoding draws no random numbers, so evaluating mid-run leaves training unchanged.
        return evaluate_tasks(model, tokenizer, env, tasks, max_new_tokens=max_new_tokens)

    losses, curve, validation_reward, step = [], [], None, 0
    for step in range(1, config.steps + 1):
        tasks = env.sample_tasks(rng, config.batch_size)
        ids, loss_mask = pad_batch(tokenizer, [
            episode_ids(tokenizer, framed.prompt_ids(t), demonstration(env, t, rng),
                        lambda sampled, reply, t=t: framed.reply_ids(t, sampled, reply))
            for t in tasks])
        loss = completion_loss(model, ids, loss_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if config.eval_every and step % config.eval_every == 0 and step < config.steps:
            curve.append((step, greedy_reward(env.eval_tasks()[: config.eval_n])))
        if validation and step >= config.min_steps and step % config.check_every == 0:
            validation_reward = greedy_reward(validation)
            if validation_reward >= config.stop_at_reward:
                break
    train_seconds = time.perf_counter() - started

    model.eval()
    metrics = {
        "steps": step,
        "validation_reward": validation_reward,
        "final_loss": losses[-1] if losses else None,
        "mean_loss_last_10": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "eval_reward": greedy_reward(env.eval_tasks()[: config.eval_n]) if config.eval_n else None,
        "train_seconds": train_seconds,
    }
    if curve:
        metrics["eval_curve"] = curve
    save_hf_folder(model, tokenizer, out_dir)
    metrics["seconds"] = time.perf_counter() - started
    return metrics


def run_chat_sft(config: ChatSFTConfig | EnvSFTConfig, out_dir: str, echo=print) -> dict:
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
                if _progress_line(line):
                    echo(line.rstrip().split("] ", 1)[-1])
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
                echo(record.getMessage())

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
    """Rank 0's lines worth showing while the store builds: step 1, every 100th, each held-out loss."""
    match = _RANK0_STEP.search(line)
    return bool(match) and (match.group(2) is not None or int(match.group(1)) % 100 == 0 or match.group(1) == "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m primebuild.runtime.sft", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="an SFTConfig as JSON (default: the defaults, a random tiny model)")
    parser.add_argument("--out", required=True, help="output HF folder (must not exist)")
    parser.add_argument("--no-early-stop", action="store_true", help="train exactly `steps` steps")
    args = parser.parse_args(argv)
    try:
        config = load_contract(SFTConfig, args.config) if args.config else SFTConfig()
        if args.no_early_stop:
            config = config.model_copy(update={"stop_at_reward": None})
        metrics = run_sft(config, args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"config": config.model_dump(mode="json"), "metrics": metrics}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
