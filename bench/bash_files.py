"""Does a tool-using task learn through verifiers' bash harness in the bubblewrap sandbox? (issue #32)

    nice -n 5 .venv/bin/python bench/bash_files.py --workspace DIR --seed 0 --port 8600

The taskset is bench/tasksets/pb_bash_files.py: "what does NAME say?", NAME's file (and two decoys) written
by the task's setup into each rollout's sandbox; reward 1 when a command printed exactly NAME's text, so
the model must copy the name from the prompt into its command. `--held-out` names (32 by default) are
never trained on.

1. Warm start (here, not a manifest: primebuild's environment SFT cannot imitate a taskset that a verifiers
   harness plays, and the taskset is a module of this folder, not an installed package a lock can pin):
   the tiny chat model (tests/chat_helpers.py) is supervised on demonstration episodes framed as the
   bash harness frames them (its system prompt, its `bash` tool, the task's prompt; the call
   `cat NAME`, the tool's result, `done`), and stopped once its greedy first turn on 64 training-side
   tasks is the right call for `--stop-at` of them: mid-way through learning to copy names, where RL
   has room to gain. Cached in the workspace per seed and stop.
2. RL through `primebuild run` on a generated manifest: the embedded engine, the real harness program and
   every command in bubblewrap, the orchestrator's greedy eval of the held-out names before, every
   `--eval-every` steps, and after.

Prints the warm start's curve, the run's held-out rewards and the sampled reward per step, and one JSON
line with the summary (held-out before/after, sampled first/last 10 steps, wall seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASKSETS = REPO / "bench" / "tasksets"
MANIFEST = """apiVersion: primebuild/v1
kind: Experiment
name: bash-files
seed: {seed}
model: {{path: {model}, dtype: float32}}
hardware: {{nodes: 1, gpus_per_node: 0, gpu: cpu, cpus_per_node: 2, host_memory_gb: 16}}
inference: {{engine: embedded, precision: fp32, max_num_seqs: 32, tool_call_parser: hermes, batch_invariant: true}}
trainer:
  ranks: 1
  precision: fp32
  activation_checkpointing: false
  micro_batch_tokens: 8192
  checkpoint_every: 1000
  optimizer: {{lr: {lr}, warmup_steps: {warmup}}}
orchestrator:
  rollouts_per_step: {rollouts}
  group_size: {group}
  max_off_policy_steps: 1
  seq_len: 1024
  max_completion_tokens: 80
  max_steps: {steps}
  temperature: {temperature}
  loss: {{name: grpo}}
  eval_every: {eval_every}
  eval_prompts: {held_out}
environments:
  - id: verifiers:pb-bash-files
    args: {{harness: bash, max_turns: 2, num_eval: {held_out}, cpu_seconds: 5, command_seconds: 5, wall_seconds: 60}}
"""


def call_text(name: str) -> str:
    from pb_bash_files import command

    return '<tool_call>{"name": "bash", "arguments": {"command": "' + command(name) + '"}}</tool_call>'


def task_name(task) -> str:
    from primebuild.runtime.envs.verifiers_adapter import VERIFIERS_TASK

    return task.info[VERIFIERS_TASK].data.name


def task_text(task) -> str:
    from primebuild.runtime.envs.verifiers_adapter import VERIFIERS_TASK

    return task.info[VERIFIERS_TASK].data.text


def harness_prompt(template, task) -> list[int]:
    """The first prompt as the bash harness sends it: its system prompt, the task's prompt, its `bash` tool."""
    from verifiers.v1.harnesses.bash.harness import BASH_SYSTEM_PROMPT
    from verifiers.v1.harnesses.utils.core import BASH_TOOL

    return template.prompt_ids([{"role": "system", "content": BASH_SYSTEM_PROMPT},
                                {"role": "user", "content": task.prompt}], tools=[BASH_TOOL])


def call_odds(folder: Path, env, temperatures: tuple[float, ...] = (1.0, 1.2)) -> dict:
    """Per temperature, the chance that a sampled first turn is exactly the right call, by teacher forcing:
    its mean over the training-side and the held-out names, split into the name's letters and the rest of
    the call (its JSON), and the share of groups of 4 with mixed outcomes (what RL can learn from)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primebuild.runtime.inference.chat_template import ChatTemplate
    from primebuild.runtime.models.chat_tokenizer import IM_END

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    template, end = ChatTemplate(tokenizer), tokenizer.convert_tokens_to_ids(IM_END)
    held_out = env.eval_tasks()
    held_names = {task_name(t) for t in held_out}
    train = list({task_name(t): t for t in env.sample_tasks(random.Random(5), 4000)
                  if task_name(t) not in held_names}.values())
    odds = {}
    for split, tasks in (("train", train), ("held_out", held_out)):
        whole, letters = {t: [] for t in temperatures}, {t: [] for t in temperatures}
        for task in tasks:  # one forward pass a task; each temperature rescales its logits
            prompt, text = harness_prompt(template, task), call_text(task_name(task))
            call = tokenizer.encode(text, add_special_tokens=False) + [end]
            name_at = len(tokenizer.encode(text[:text.index(task_name(task))], add_special_tokens=False))
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([prompt + call])).logits[0, len(prompt) - 1:-1]
            for temperature in temperatures:
                lp = torch.log_softmax(logits / temperature, -1)[torch.arange(len(call)), torch.tensor(call)]
                whole[temperature].append(lp.sum().exp().item())
                letters[temperature].append(lp[name_at:name_at + 2].sum().exp().item())
        n = len(tasks)
        for temperature in temperatures:
            w, x = whole[temperature], letters[temperature]
            odds[f"{split} T={temperature}"] = {
                "names": n, "right call": round(sum(w) / n, 3), "name letters": round(sum(x) / n, 3),
                "rest of the call": round(sum(a / max(b, 1e-30) for a, b in zip(w, x, strict=True)) / n, 3),
                "mixed groups of 4": round(sum(1 - q ** 4 - (1 - q) ** 4 for q in w) / n, 3)}
    return odds


def warm_start(folder: Path, env, seed: int, stop_at: float, max_steps: int, lr: float, batch: int,
               check_every: int) -> dict:
    """Supervise the tiny chat model on demonstrations until its greedy call is right for `stop_at` of the
    training-side validation tasks (checked every `check_every` steps); returns the curve."""
    import torch
    from chat_helpers import masked_lm_step, save_chat_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verifiers.v1.harnesses.utils.core import BASH_TOOL

    from primebuild.runtime.evaluate import greedy_ids
    from primebuild.runtime.inference.chat_template import ChatTemplate
    from primebuild.runtime.models.chat_tokenizer import IM_END

    save_chat_model(folder, seed=2)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    template, tools, end = ChatTemplate(tokenizer), [BASH_TOOL], tokenizer.convert_tokens_to_ids(IM_END)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def episode(task) -> tuple[list[int], list[int]]:
        ids = harness_prompt(template, task)
        mask = [0] * len(ids)
        call = tokenizer.encode(call_text(task_name(task)), add_special_tokens=False) + [end]
        reply = template.continuation_ids(call, [{"role": "tool", "content": task_text(task)}], tools=tools)
        last = tokenizer.encode("done", add_special_tokens=False) + [end]
        return ids + call + reply + last, mask + [1] * len(call) + [0] * len(reply) + [1] * len(last)

    def right_calls(tasks) -> float:
        model.eval()
        rows = greedy_ids(model, [harness_prompt(template, t) for t in tasks], 80, eos_id=end,
                          pad_id=tokenizer.pad_token_id)
        model.train()
        wanted = [call_text(task_name(t)) for t in tasks]
        return sum(tokenizer.decode(r, skip_special_tokens=False).removesuffix(IM_END) == w
                   for r, w in zip(rows, wanted, strict=True)) / len(tasks)

    rng = random.Random(seed)
    validation = env.sample_tasks(random.Random(1_000_003), 64)  # training-side names
    held_out = env.eval_tasks()
    curve, started, step = [], time.perf_counter(), 0
    for step in range(1, max_steps + 1):
        rows = [episode(t) for t in env.sample_tasks(rng, batch)]
        loss = masked_lm_step(model, optimizer, rows)
        if step % check_every == 0:
            point = {"step": step, "loss": round(loss.item(), 4), "validation": right_calls(validation),
                     "held_out": right_calls(held_out), "seconds": round(time.perf_counter() - started, 1)}
            curve.append(point)
            print("warm start", point, flush=True)
            if point["validation"] >= stop_at:
                break
    model.save_pretrained(folder)
    return {"steps": step, "seconds": round(time.perf_counter() - started, 1), "curve": curve}


def framing_matches(run: Path, model: Path) -> bool:
    """Is the prompt the harness sent (step 1's first recorded sample) token for token the one the warm
    start was supervised on? A mismatch would mean the warm start imitated another conversation."""
    import re
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from primebuild.contracts.run_dir import RunDir
    from primebuild.runtime.inference.chat_template import ChatTemplate
    from primebuild.runtime.rollout_file import load_batch

    sample = load_batch(RunDir(run).rollout(1)).samples[0]
    tokenizer = AutoTokenizer.from_pretrained(model)
    asked = re.search(r"what does (\S+) say\?", tokenizer.decode(sample.prompt_ids)).group(0)
    return list(sample.prompt_ids) == harness_prompt(ChatTemplate(tokenizer), SimpleNamespace(prompt=asked))


def sampled_and_eval(run: Path) -> tuple[list[float], list[tuple[int, float]]]:
    from primebuild.contracts.run_dir import RunDir

    rewards, evals = {}, []
    for line in RunDir(run).metrics.read_text().splitlines():
        row = json.loads(line)
        if row.get("role") != "orchestrator":
            continue
        if row["name"] == "reward_mean":
            rewards[row["step"]] = row["value"]
        elif row["name"] == "eval_reward":
            evals.append((row["step"], row["value"]))
    return [rewards[s] for s in sorted(rewards)], evals


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0, help="the RL run's seed (the warm start is seed 0's)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stop-at", type=float, default=0.3)
    parser.add_argument("--sft-steps", type=int, default=1000)
    parser.add_argument("--sft-lr", type=float, default=2e-3)
    parser.add_argument("--check-every", type=int, default=20,
                        help="warm-start steps between validation checks (the copy comes suddenly: 20 overshoots)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature of the RL rollouts (above 1: more names with mixed outcomes a group)")
    parser.add_argument("--held-out", type=int, default=32,
                        help="names held out of training and evaluated greedily (each is 1/N of the score)")
    parser.add_argument("--sft-only", action="store_true")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO / "tests"), str(TASKSETS)]
    import torch

    from primebuild.contracts.run_dir import find_run
    from primebuild.runtime.envs.registry import load_environment

    torch.set_num_threads(1)  # the cores are shared: a second thread waits more than it helps
    env = load_environment("verifiers:pb-bash-files", None, {"harness": "bash", "max_turns": 2, "num_eval": args.held_out})
    ws = args.workspace.resolve()
    model = ws / (f"model-stop{args.stop_at}" + (f"-every{args.check_every}" if args.check_every != 20 else "")
                  + (f"-held{args.held_out}" if args.held_out != 32 else ""))  # another split, another warm start
    if not (model / "warm_start.json").exists():
        info = warm_start(model, env, 0, args.stop_at, args.sft_steps, args.sft_lr, 16, args.check_every)
        (model / "warm_start.json").write_text(json.dumps(info))
    info = json.loads((model / "warm_start.json").read_text())
    print("warm start:", info["steps"], "steps,", info["seconds"], "s; last", info["curve"][-1], flush=True)
    for split, row in call_odds(model, env).items():
        print(f"warm start, odds of the right call sampled ({split}):", row, flush=True)
    if args.sft_only:
        return
    manifest = ws / f"bash-files-seed{args.seed}{model.name.removeprefix('model')}.yaml"  # one per warm start
    manifest.write_text(MANIFEST.format(model=model, seed=args.seed, lr=args.lr, warmup=args.warmup,
                                        rollouts=args.rollouts, group=args.group, steps=args.steps,
                                        eval_every=args.eval_every, temperature=args.temperature,
                                        held_out=args.held_out))
    env_vars = {**os.environ, "PRIMEBUILD_STORE": str(ws / "store"),
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), str(TASKSETS), os.environ.get("PYTHONPATH")) if p)}
    runs = ws / "runs" / manifest.stem  # a folder per seed and warm start: seeds run side by side
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "primebuild.cli", "run", str(manifest), "--set",
                           f"inference.port={args.port}", "--runs-dir", str(runs)], env=env_vars, text=True,
                          capture_output=True)
    wall = time.monotonic() - started
    print(done.stdout[-2000:], done.stderr[-3000:] if done.returncode else "")
    run = find_run(None, runs).root
    sampled, evals = sampled_and_eval(run)
    print("held-out (step: greedy reward):", evals)
    print("the harness's prompt is the warm start's:", framing_matches(run, model))
    print("sampled reward per step:", [round(r, 3) for r in sampled])
    first, last = sampled[:10], sampled[-10:]
    print(json.dumps({"seed": args.seed, "run": str(run), "rc": done.returncode, "wall_s": round(wall, 1),
                      "load": os.getloadavg(), "held_out_before": evals[0][1] if evals else None,
                      "held_out_after": evals[-1][1] if len(evals) > 1 and evals[-1][0] == args.steps else None,
                      "sampled_first10": sum(first) / max(1, len(first)),
                      "sampled_last10": sum(last) / max(1, len(last)),
                      "warm_start_steps": info["steps"]}))


if __name__ == "__main__":
    main()
