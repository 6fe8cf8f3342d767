"""A tiny real run of verifiers' bash harness in the bubblewrap sandbox (primebuild/runtime/envs/sandbox_runtime.py).

    .venv/bin/python bench/bash_harness.py --workspace DIR --steps 12

The task (tests/test_bash_harness.py SECRET_TASKSET): "what does secret.txt say?", where the file is written
by the task's setup into the rollout's sandbox only; reward 1 when the output of a command the model ran
holds the file's text. The model is the tiny chat model taught (200 steps) to answer with the bash call
`cat secret.txt` under the bash harness's system prompt, so RL starts from a policy that calls the tool
well enough at greedy decoding and sometimes garbles the call when sampled at temperature 1. Prints the
run's output, then per step how many rollouts ran a command in the sandbox (their tool results are in
the trained sequence, mask 0) and their rewards.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MANIFEST = """apiVersion: primebuild/v1
kind: Experiment
name: bash-secret
seed: 0
model: {{path: {model}, dtype: float32}}
hardware: {{nodes: 1, gpus_per_node: 0, gpu: cpu, cpus_per_node: 2, host_memory_gb: 16}}
inference: {{engine: embedded, precision: fp32, max_num_seqs: 16, tool_call_parser: hermes}}
trainer:
  ranks: 1
  precision: fp32
  activation_checkpointing: false
  micro_batch_tokens: 4096
  checkpoint_every: 100
  optimizer: {{lr: 3.0e-4}}
orchestrator:
  rollouts_per_step: 8
  group_size: 4
  max_off_policy_steps: 1
  seq_len: 1024
  max_completion_tokens: 80
  max_steps: {steps}
  temperature: 1.0
  loss: {{name: grpo}}
  eval_every: 0
  eval_prompts: 2
environments:
  - id: verifiers:pb-bash-secret
    args: {{harness: bash, max_turns: 3, num_eval: 2, cpu_seconds: 5, command_seconds: 5, wall_seconds: 60}}
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    import test_bash_harness as t
    from chat_helpers import save_chat_model, train_tool_caller
    from verifiers.v1.harnesses.bash.harness import BASH_SYSTEM_PROMPT
    from verifiers.v1.harnesses.utils.core import BASH_TOOL

    from primebuild.contracts.run_dir import find_run

    ws = args.workspace.resolve()
    model, tasksets = ws / "model", ws / "tasksets"
    if not model.exists():
        save_chat_model(model, seed=2)
        print("taught the bash call, loss", train_tool_caller(model, [BASH_TOOL], t.CALL, "done", system=BASH_SYSTEM_PROMPT))
    tasksets.mkdir(parents=True, exist_ok=True)
    (tasksets / "pb_bash_secret.py").write_text(t.SECRET_TASKSET)
    manifest = ws / "bash-secret.yaml"
    manifest.write_text(MANIFEST.format(model=model, steps=args.steps))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PRIMEBUILD_STORE": str(ws / "store"),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(tasksets), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "primebuild.cli", "run", str(manifest), "--set",
                           f"inference.port={port}", "--runs-dir", str(ws / "runs")], env=env, text=True,
                          capture_output=True)
    print(done.stdout[-3000:], done.stderr[-2000:] if done.returncode else "")
    report(find_run(None, ws / "runs").root, model)


def report(run: Path, model: Path) -> None:
    from transformers import AutoTokenizer

    from primebuild.runtime.rollout_file import load_batch

    tokenizer = AutoTokenizer.from_pretrained(model)
    for batch in sorted((run / "rollouts").glob("step_*.safetensors")):
        samples = load_batch(batch).samples
        ran = [s for s in samples if "<tool_response>" in tokenizer.decode(s.completion_ids)]
        print(f"{batch.stem}: {len(ran)}/{len(samples)} ran a command in the sandbox; rewards "
              f"{[s.reward for s in samples]}")


if __name__ == "__main__":
    main()
