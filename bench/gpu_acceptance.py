"""The RL jobs of bench/gpu_acceptance.sh: a shipped manifest run end to end on one GPU machine with vLLM
(the CUDA wheel) as its inference engine, and its figures read back from metrics.jsonl.

    python bench/gpu_acceptance.py job vllm_main   --vllm-python P --runs-dir DIR --out JSON [--dry-run]
    python bench/gpu_acceptance.py job mismatch_r3 --vllm-python P --runs-dir DIR --out JSON [--dry-run]

The model is built from architecture facts the repo ships (`model: init: random`, manifests/models/*.json,
character tokenizer): no download. GPU plans put inference and the trainer on nodes of their own, so each
job is compiled for two plan nodes that are both this machine (an ssh-target plan whose two hosts are
127.0.0.1) and run by the local target's supervisor: vLLM on GPU 0 with half its memory, the trainer on
the same GPU 0 beside it. `--dry-run` compiles the plan and checks what the job relies on (the vLLM
environment the plan selects is the CUDA one; vLLM returns routed experts where router replay is on)
without starting anything: it runs on CPU, in CI.

- vllm_main: reverse-text-vllm on the random tiny dense model, bf16: rollout tokens/s (orchestrator),
  seconds per trainer step (step_s), steps trained.
- mismatch_r3: reverse-text-moe (tiny Qwen3-MoE, router replay on) on vLLM, synchronous (the sampling
  weights are the trained ones): the trainer's mismatch KL with the routes vLLM returned replayed
  (`mismatch_kl`) and without them (`mismatch_kl_no_replay`), per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"
ONE_GPU_TWICE = ["hardware={nodes: 2, gpus_per_node: 1, gpu: h200, host_memory_gb: 128}",
                 "target={kind: ssh, hosts: [127.0.0.1, 127.0.0.1]}",
                 "inference.gpu_memory_utilization=0.5",  # the trainer shares the GPU
                 "inference.precision=bf16"]
JOBS = {
    "vllm_main": ("reverse-text-vllm.yaml", [
        "model={init: random, facts: models/reverse-text-tiny.json, tokenizer: char, dtype: bfloat16}",
        "trainer={micro_batch_tokens: 512}", *ONE_GPU_TWICE,
        "orchestrator.max_steps=12", "orchestrator.eval_every=0"]),
    "mismatch_r3": ("reverse-text-moe.yaml", [
        "model={init: random, facts: models/reverse-text-moe.json, tokenizer: char, dtype: bfloat16}",
        "trainer={micro_batch_tokens: 2048}", "inference.engine=vllm", *ONE_GPU_TWICE,
        "orchestrator.max_steps=8", "orchestrator.eval_every=0", "orchestrator.max_off_policy_steps=0"]),
}


def plan_of(job: str):
    from primebuild.builders.plan import compile_plan
    from primebuild.manifest.load import load_manifest

    manifest, sets = JOBS[job]
    loaded = load_manifest(MANIFESTS / manifest, sets)
    return loaded, compile_plan(loaded)


def check(job: str, plan) -> list[str]:
    """What the job relies on, read from its plan; [] when all holds."""
    from primebuild.builders import vllm_env

    problems = []
    inference = [p for p in plan.processes if p.role == "inference"]
    if not inference or any(p.environment != "vllm" for p in inference):
        problems.append("the inference processes do not run in the vLLM environment")
    chosen = vllm_env.for_hardware(plan.hardware)
    if chosen.distribution != "vllm" or chosen.device != "cuda":
        problems.append(f"the plan selects {chosen.name}, not the CUDA wheel")
    if job == "mismatch_r3" and not all("--enable-return-routed-experts" in p.argv for p in inference):
        problems.append("router replay is on but vLLM is not asked to return routed experts")
    return problems


def run_job(job: str, loaded, plan, vllm_python: str, runs_dir: Path) -> dict:
    from primebuild.builders.store import Store
    from primebuild.contracts.plan import render_json
    from primebuild.contracts.run_dir import RunDir
    from primebuild.runtime.derivations import resolve_model
    from primebuild.runtime.supervisor import QUIET
    from primebuild.runtime.targets.local import LocalTarget

    started = time.monotonic()
    model = resolve_model(loaded, Store(), print)
    run = RunDir((runs_dir / job).resolve())
    run.root.mkdir(parents=True, exist_ok=False)
    run.plan.write_text(render_json(plan))
    run.run_record.write_text(json.dumps({"model_path": str(model.path), "environments": {"vllm": vllm_python},
                                          "target": "local"}))
    run.logs.mkdir()
    target = LocalTarget()
    record = target.launch(run, plan, echo=print, verbosity=QUIET)
    outcome = target.follow(run, record, echo=print, verbosity=QUIET)
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines()] if run.metrics.is_file() else []

    def series(name: str) -> list[float]:
        return [r["value"] for r in rows if r.get("name") == name and isinstance(r.get("value"), int | float)]

    result = {"ok": outcome.ok, "message": outcome.message, "run_dir": str(run.root),
              "seconds": round(time.monotonic() - started, 1), "steps_trained": len(series("loss"))}
    for name in ("tokens_per_s", "step_s", "mismatch_kl", "mismatch_kl_no_replay"):
        values = series(name)
        if values:
            result[name] = {"median": statistics.median(values), "last": values[-1], "n": len(values)}
    if "mismatch_kl" in result and "mismatch_kl_no_replay" in result:
        on, off = result["mismatch_kl"]["median"], result["mismatch_kl_no_replay"]["median"]
        result["replay_cuts_kl_by"] = off / on if on else None
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    job = sub.add_parser("job", help="run (or with --dry-run: check) one RL job")
    job.add_argument("name", choices=sorted(JOBS))
    job.add_argument("--vllm-python", default=None, help="the CUDA vLLM environment's python (scripts/vllm-env --gpu)")
    job.add_argument("--runs-dir", type=Path, default=Path("runs"))
    job.add_argument("--out", type=Path, default=None)
    job.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)

    loaded, plan = plan_of(args.name)
    problems = check(args.name, plan)
    result: dict = {"job": args.name, "plan_hash": plan.plan_hash, "problems": problems}
    if problems:
        result["ok"] = False
    elif args.dry_run:
        result["ok"] = True
        result["dry_run"] = True
    elif not args.vllm_python:
        result.update(ok=False, message="no CUDA vLLM environment (scripts/vllm-env --gpu makes one; it needs "
                                        "the network once)")
    else:
        result.update(run_job(args.name, loaded, plan, args.vllm_python, args.runs_dir))
    text = json.dumps(result, indent=2, sort_keys=True)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
