"""The orchestrator: turns inference samples into trainer batches and keeps both sides busy.

Steps are 1-based, like the trainer's. Step k, in order:
  1. wait until the trainer has published a policy no older than k - 1 - max_off_policy_steps
     (0 = synchronous RL; 1 lets step k's rollouts overlap the training of step k-1);
  2. if the servers run an older policy: pause -> update_weights -> resume on every server;
  3. draw rollouts_per_step / group_size tasks (seeded by step, so a resumed run draws the same ones),
     ask for group_size samples of each, score them, compute group-relative advantages;
  4. write rollouts/step_k.pt atomically; the trainer picks it up.
Versions: the base model is policy version 0; weights/step_k (trained on batch k) is version k.

Resume: the next step is the first batch not yet on disk, so a restarted orchestrator neither loses nor
repeats a step; a restarted inference server comes back on version 0 and gets the latest weights pushed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time

import torch

from primebuild.contracts.base import load_contract
from primebuild.contracts.orchestrator import OrchestratorConfig
from primebuild.contracts.run_dir import RunDir, write_json_atomic
from primebuild.errors import UserError
from primebuild.kernels.routing import sample_routes
from primebuild.runtime.orchestrator.client import InferenceClient
from primebuild.runtime.orchestrator.mixture import EnvironmentMix
from primebuild.runtime.orchestrator.vllm_client import VllmClient
from primebuild.runtime.orchestrator.weights import weight_source
from primebuild.runtime.trackers import open_sinks
from primebuild.runtime.trainer.advantages import advantages_by_group
from primebuild.runtime.trainer.batch import Sample, TrainBatch, routing_bytes, save_batch
from primebuild.runtime.trainer.metrics import MetricsWriter

log = logging.getLogger("primebuild.orchestrator")


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg
        self.run_dir = RunDir(cfg.run_dir)
        client = VllmClient if cfg.engine == "vllm" else InferenceClient
        self.clients = [client.from_env(u, cfg.served_model_name, retry_seconds=cfg.retry_seconds)
                        for u in cfg.endpoints]
        self.mix = EnvironmentMix(cfg.environments)
        self.metrics = MetricsWriter(self.run_dir.metrics, role="orchestrator",
                                     sinks=open_sinks(cfg.trackers, self.run_dir, "orchestrator"))
        self.server_version = 0
        self.sync_lock = asyncio.Lock()
        self.weights = weight_source(cfg.weight_sync, self.run_dir, cfg.keep_weights)

    # --- policy versions -------------------------------------------------------------------------

    async def wait_for_version(self, at_least: int) -> int:
        while True:
            version = await self.weights.latest(self.clients)
            if version >= at_least:
                return version
            if self.stop_requested():
                raise asyncio.CancelledError
            await asyncio.sleep(0.02)

    async def sync_servers(self) -> None:
        """Bring every server to the newest published policy (also after a server restarted)."""
        async with self.sync_lock:
            await self._sync_servers()

    async def _sync_servers(self) -> None:
        version = await self.weights.latest(self.clients)
        versions = await asyncio.gather(*(c.version() for c in self.clients))
        stale = [c for c, v in zip(self.clients, versions, strict=True) if v != version]
        if version > 0 and stale:
            await asyncio.gather(*(self.weights.load(c, version) for c in stale))
        self.server_version = version
        self.weights.retire(version)

    def stop_requested(self) -> bool:
        return self.run_dir.stop_requested()

    # --- sampling --------------------------------------------------------------------------------

    async def sample_group(self, index: int, env, task, step: int) -> list[tuple[Sample, str]]:
        cfg = self.cfg
        client = self.clients[index % len(self.clients)]
        while True:
            response = await client.complete(
                env.format_prompt(task), n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p,
                max_tokens=cfg.max_completion_tokens, seed=cfg.seed * 1_000_003 + step * 10_007 + index,
                routed_experts=cfg.router_replay)
            if min(c.policy_version for c in response.choices) >= self.server_version:
                break
            # The server restarted on the base weights: give it the current policy, sample again.
            log.info("a server answered with an older policy than v%d: re-syncing it", self.server_version)
            await self.sync_servers()
        out = []
        for choice in response.choices:
            reward = float(env.score(task, choice.text))
            out.append((Sample(
                prompt_ids=list(choice.prompt_token_ids), completion_ids=list(choice.token_ids),
                inference_logprobs=list(choice.token_logprobs), advantage=0.0, reward=reward,
                policy_version=choice.policy_version, env_id=env.id, routed_experts=self.routes_of(choice)),
                choice.text))
        return out

    def routes_of(self, choice) -> torch.Tensor | None:
        """Router replay: the choice's routes as one [fed positions, moe_layers, top_k] uint8/uint16 tensor."""
        if not self.cfg.router_replay:
            return None
        routes = sample_routes(choice.routed_experts, self.cfg.moe_layers, len(choice.prompt_token_ids),
                               len(choice.token_ids))
        return torch.from_numpy(routes)

    async def make_batch(self, step: int) -> TrainBatch:
        cfg = self.cfg
        rng = random.Random(cfg.seed * 1_000_003 + step)
        tasks = self.mix.sample(rng, cfg.rollouts_per_step // cfg.group_size)
        groups = await asyncio.gather(*(self.sample_group(i, env, t, step) for i, (env, t) in enumerate(tasks)))
        samples = [s for group in groups for s, _ in group]
        group_ids = [i for i, group in enumerate(groups) for _ in group]
        advantages = advantages_by_group([s.reward for s in samples], group_ids, cfg.normalize_advantage_std)
        for s, a in zip(samples, advantages, strict=True):
            s.advantage = a
        return TrainBatch(step=step, samples=samples, metadata={"max_completion_tokens": cfg.max_completion_tokens,
                                                                  "temperature": cfg.temperature})

    async def evaluate(self) -> float:
        tasks = self.mix.eval_tasks(self.cfg.eval_prompts)

        async def one(i: int, env, task) -> float:
            r = await self.clients[i % len(self.clients)].complete(
                env.format_prompt(task), n=1, temperature=0.0, top_p=1.0,
                max_tokens=self.cfg.max_completion_tokens)
            return float(env.score(task, r.choices[0].text))

        scores = await asyncio.gather(*(one(i, env, t) for i, (env, t) in enumerate(tasks)))
        return sum(scores) / len(scores)

    # --- the loop --------------------------------------------------------------------------------

    def first_missing_step(self) -> int:
        step = 1
        while self.run_dir.rollout(step).exists():
            step += 1
        return step

    async def run(self) -> dict:
        cfg = self.cfg
        started = time.monotonic()
        start = self.first_missing_step()
        await self.sync_servers()
        summary_path = self.run_dir.orchestrator_state
        summary = self.run_dir.read_json(summary_path)
        if "eval_reward_before" not in summary:
            summary["eval_reward_before"] = await self.evaluate()
            self.metrics.write(0, {"eval_reward": summary["eval_reward_before"],
                                   "eval_policy_version": self.server_version})
            write_json_atomic(summary_path, summary)
        log.info("eval reward before RL: %.4f; starting at step %d", summary["eval_reward_before"], start)

        for step in range(start, cfg.max_steps + 1):
            if self.stop_requested():
                log.info("stop requested: leaving after step %d", step - 1)
                break
            t0 = time.monotonic()
            await self.wait_for_version(step - 1 - cfg.max_off_policy_steps)
            waited = time.monotonic() - t0
            await self.sync_servers()
            t1 = time.monotonic()
            batch = await self.make_batch(step)
            generation = time.monotonic() - t1
            save_batch(self.run_dir.rollout(step), batch)
            rewards = [s.reward for s in batch.samples]
            tokens = sum(len(s.completion_ids) for s in batch.samples)
            mean = sum(rewards) / len(rewards)
            self.metrics.write(step, {
                "reward_mean": mean,
                "reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
                "off_policy_lag": step - 1 - min(s.policy_version for s in batch.samples),
                "policy_version": self.server_version, "generation_seconds": generation,
                "wait_seconds": waited, "tokens_per_s": tokens / max(generation, 1e-9),
                "completion_tokens": tokens, **routing_bytes(batch.samples)})
            if cfg.eval_every and step % cfg.eval_every == 0:
                self.metrics.write(step, {"eval_reward": await self.evaluate(),
                                          "eval_policy_version": self.server_version})

        final = await self.wait_for_version(cfg.max_steps)
        await self.sync_servers()
        served = await asyncio.gather(*(c.version() for c in self.clients))
        if set(served) != {final}:  # the final eval must see the weights of the last trained step
            raise RuntimeError(f"servers serve policy versions {sorted(set(served))} after syncing to {final}")
        summary["eval_reward_after"] = await self.evaluate()
        summary["eval_reward_after_step"] = final  # the trained step whose weights the eval used
        summary["inference_engine"] = await self.clients[0].engine()
        summary["orchestrator_seconds"] = round(time.monotonic() - started, 2)
        self.metrics.write(cfg.max_steps, {"eval_reward": summary["eval_reward_after"], "eval_policy_version": final})
        write_json_atomic(summary_path, summary)
        log.info("eval reward after RL: %.4f (weights of step %d)", summary["eval_reward_after"], final)
        for c in self.clients:
            await c.close()
        return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="primebuild-orchestrator")
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress
    orchestrator = None
    try:
        orchestrator = Orchestrator(load_contract(OrchestratorConfig, args.config))
        asyncio.run(orchestrator.run())
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except asyncio.CancelledError:
        log.info("stopped before the last step")
        return 0
    finally:
        if orchestrator is not None:
            orchestrator.metrics.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
