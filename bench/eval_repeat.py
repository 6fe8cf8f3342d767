"""Does a greedy held-out eval of fixed weights score the same every time? `inference.batch_invariant` off vs on.

The embedded engine in this process (its scheduler thread and continuous batching, as in the server), one
model folder and one environment's held-out tasks. Each repeat sends every held-out prompt greedy, as the
orchestrator's eval does, while `--background` requests sample at temperature 1 (rollouts in flight), all
submitted at random moments over a few milliseconds, so that which requests share a batch step changes from
repeat to repeat. Per mode it prints the distinct eval scores over the repeats, how many tasks' greedy
completions differed from that task's completion alone, and the largest log-prob difference from alone.

    python bench/eval_repeat.py --model ~/.cache/primebuild/store/<hash>-reverse-text-sft --env reverse-text
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from pathlib import Path

import torch

from primebuild.runtime.envs.framing import framing
from primebuild.runtime.envs.registry import load_environment
from primebuild.runtime.inference.engine import Engine
from primebuild.runtime.inference.sampling import SamplingParams
from primebuild.runtime.inference.sequences import ChoiceResult
from primebuild.runtime.inference.tokenizer import ServedTokenizer
from primebuild.runtime.tokenizer_loading import load_tokenizer


def run_all(engine: Engine, requests: list[tuple[list[int], SamplingParams]], rng: random.Random) -> list[ChoiceResult]:
    """Submit every request at a random moment within ~20 ms; wait for all."""
    results = [ChoiceResult(0, list(prompt)) for prompt, _ in requests]
    left = [len(requests)]
    done = threading.Event()
    lock = threading.Lock()

    def sink_for(result: ChoiceResult):
        def sink(updates):
            for update in updates:
                result.apply(update)
                if update.finish_reason is not None:
                    with lock:
                        left[0] -= 1
                        if left[0] == 0:
                            done.set()
        return sink

    order = list(range(len(requests)))
    rng.shuffle(order)
    for i in order:
        prompt, params = requests[i]
        engine.submit(prompt, params, sink_for(results[i]))
        time.sleep(rng.uniform(0, 0.002))
    if not done.wait(600):
        raise TimeoutError("requests did not finish")
    return results


def measure(folder: Path, env_id: str, invariant: bool, repeats: int, background: int, max_tokens: int,
            seed: int) -> dict:
    env = load_environment(env_id)
    tasks = env.eval_tasks()
    frame = framing(env, load_tokenizer(folder))
    prompts = [frame.prompt_ids(t) for t in tasks]
    served = ServedTokenizer(folder)
    engine = Engine(folder, device="cpu", max_num_seqs=len(prompts) + background, max_model_len=256,
                    eos_token_ids=served.eos_token_ids, batch_invariant=invariant)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    try:
        alone = [engine.generate([p], greedy)[0][0] for p in prompts]
        rng = random.Random(seed)
        scores, differing, worst = [], set(), 0.0
        for _ in range(repeats):
            noise = [(rng.choice(prompts), SamplingParams(max_tokens=rng.randrange(1, max_tokens + 1),
                                                         temperature=1.0)) for _ in range(background)]
            results = run_all(engine, [(p, greedy) for p in prompts] + noise, rng)[:len(prompts)]
            rewards = [env.score(t, served.decode(r.token_ids)) for t, r in zip(tasks, results, strict=True)]
            scores.append(sum(rewards) / len(rewards))
            for i, (mine, solo) in enumerate(zip(results, alone, strict=True)):
                if mine.token_ids != solo.token_ids:
                    differing.add(i)
                worst = max([worst, *(abs(a - b) for a, b in zip(mine.logprobs, solo.logprobs, strict=False))])
        alone_score = sum(env.score(t, served.decode(r.token_ids)) for t, r in zip(tasks, alone, strict=True))
    finally:
        engine.shutdown()
    return dict(tasks=len(tasks), alone=alone_score / len(tasks), scores=scores, differing=len(differing), worst=worst)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="an HF model folder (e.g. a store entry)")
    parser.add_argument("--env", default="reverse-text")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--background", type=int, default=32, help="sampled requests in flight beside the eval")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.model.name}, {args.env}, {args.repeats} repeats, {args.background} sampled requests beside "
          f"the eval, {args.threads} thread(s)")
    print(f"{'batch_invariant':<16} {'tasks':>5} {'score alone':>11} {'distinct scores over repeats':<40} "
          f"{'tasks != alone':>14} {'max |dlogp|':>11}")
    for invariant in (False, True):
        r = measure(args.model, args.env, invariant, args.repeats, args.background, args.max_tokens, args.seed)
        distinct = sorted({round(s, 6) for s in r["scores"]})
        print(f"{str(invariant):<16} {r['tasks']:>5} {r['alone']:>11.4f} {str(distinct):<40} "
              f"{r['differing']:>14} {r['worst']:>11.2e}", flush=True)


if __name__ == "__main__":
    main()
