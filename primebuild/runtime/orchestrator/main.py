"""The orchestrator: runs rollouts through the inference servers and cuts trainer batches from them.

Steps are 1-based, like the trainer's: batch k is what the trainer's k-th optimizer step trains on, and
weights/step_k (trained on batch k) is policy version k; the base model is version 0.

Rollouts come from a continuous pool (pool.py: the staleness, admission and drop policy, docs/async.md):
groups of `group_size` episodes of one task run concurrently, each model turn a request to the server
that holds the newest policy; as soon as `rollouts_per_step / group_size` groups that batch k accepts
have finished, batch k is written (rollouts/step_k.pt, atomically) and the trainer picks it up. Whenever
the trainer publishes new weights the servers are brought to them (pause -> update -> resume; in-flight
requests resume on the new weights). With max_off_policy_steps 0 this is synchronous RL: one batch's
groups, all sampled by the weights that batch trains. With several environments every batch holds each
one's share of its groups by weight, asynchronous too (pool.py).

Resume: the next batch is the first not on disk, so a restarted orchestrator neither loses nor repeats
a step; groups that were running when it stopped are simply not in any batch, and the group stream
continues after the last one written (recorded in each batch: RolloutBatch.next_group). A restarted inference server
comes back on version 0 and gets the latest weights pushed.

Elastic inference (servers.py): a server that stops answering is set aside and its in-flight requests go
to the others; it takes requests again once it is back and on the current weights. Servers the
supervisor adds (`primebuild scale --inference +1`) join the same way; retired ones are drained.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import numpy as np

from primebuild.contracts.completion import CompletionResult, SampledChoice
from primebuild.contracts.orchestrator import OrchestratorConfig
from primebuild.contracts.rollout import RolloutBatch
from primebuild.contracts.run_dir import RunDir
from primebuild.contracts.run_summary import OrchestratorSummary
from primebuild.kernels.routing import sample_routes
from primebuild.runtime.config_main import config_main
from primebuild.runtime.inference.vllm.admin import VllmAdminError
from primebuild.runtime.metrics import MetricsWriter, read_metrics
from primebuild.runtime.orchestrator.advantages import advantages_by_group
from primebuild.runtime.orchestrator.client import InferenceClient, ServerGone, WeightUpdateLost
from primebuild.runtime.orchestrator.curriculum import Curriculum
from primebuild.runtime.orchestrator.failures import RolloutsFailing, cause, costs_the_run
from primebuild.runtime.orchestrator.mixture import EnvironmentMix
from primebuild.runtime.orchestrator.pool import Group, IdleClock, RolloutPool
from primebuild.runtime.orchestrator.rollout import RolloutRunner
from primebuild.runtime.orchestrator.servers import STATE_SECONDS, ServerSet
from primebuild.runtime.orchestrator.teacher import TeacherScorer
from primebuild.runtime.orchestrator.vllm_client import VllmClient
from primebuild.runtime.orchestrator.weights import weight_source
from primebuild.runtime.rollout_file import load_batch, routing_bytes, save_batch
from primebuild.runtime.tokenizer_loading import load_tokenizer
from primebuild.runtime.trackers import open_sinks

log = logging.getLogger("primebuild.orchestrator")

POLL_SECONDS = 0.02  # how often new weights and a STOP file are looked for while rollouts run
ADMIT_RETRY_S = 0.2  # how often a server joining the weight group is asked again while it starts


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig):
        self.cfg = cfg
        self.run_dir = RunDir(cfg.run_dir)
        if cfg.engine == "vllm":  # a client also watches the servers its endpoint's requests reach
            self.clients = [VllmClient.from_env(u, cfg.served_model_name, retry_seconds=cfg.retry_seconds,
                                                max_requests=cfg.max_requests_per_endpoint,
                                                members=[j.url for j in cfg.weight_broadcast if j.endpoint == i])
                            for i, u in enumerate(cfg.endpoints)]
        else:
            self.clients = [self.new_client(u) for u in cfg.endpoints]
        self.mix = EnvironmentMix(cfg.environments)
        self.metrics = MetricsWriter(self.run_dir.metrics, role="orchestrator",
                                     sinks=open_sinks(cfg.trackers, self.run_dir, "orchestrator"))
        self.server_version = 0
        self.sync_lock = asyncio.Lock()
        self.servers = ServerSet(self.clients, self.run_dir, self.new_client, cfg.retry_seconds)
        self.weights = weight_source(cfg.weight_sync, self.run_dir, cfg.keep_weights)
        self.runner = RolloutRunner(load_tokenizer(cfg.model_path),
                                    max_tokens_per_turn=cfg.max_completion_tokens, seq_len=cfg.seq_len,
                                    routes_of=self.routes_of if cfg.router_replay else None)
        self.groups_per_step = cfg.rollouts_per_step // cfg.group_size
        self.curriculum = None  # orchestrator.curriculum: prompts from easy / normal / hard pools
        if cfg.curriculum is not None:
            self.curriculum = Curriculum(cfg.curriculum, self.mix.envs, self.mix.names, cfg.seed, self.groups_per_step)
        self.teacher = None  # on-policy distillation: the teacher's server scores each batch's tokens
        if cfg.teacher is not None:
            self.teacher = TeacherScorer(InferenceClient.from_env(cfg.teacher.url, cfg.teacher.served_model_name,
                                                                  retry_seconds=cfg.retry_seconds,
                                                                  max_requests=cfg.max_requests_per_endpoint))
        self.requests = IdleClock()  # time with no request in flight on any server

    def new_client(self, url: str) -> InferenceClient:
        """A client of an embedded server (scale adds only those: supervisor/scale.py)."""
        cfg = self.cfg
        return InferenceClient.from_env(url, cfg.served_model_name, retry_seconds=cfg.retry_seconds,
                                        max_requests=cfg.max_requests_per_endpoint)

    # --- policy versions -------------------------------------------------------------------------

    async def newest_on_active_servers(self) -> int:
        """The newest version the weight source has for the active servers; -1 while none is active (every
        server down: tend_servers brings each back on the current weights). One found gone is set aside."""
        while True:
            active = [s for s in self.servers.servers.values() if s.state == "active"]
            if not active:
                return -1
            try:
                return await self.weights.latest([s.client for s in active])
            except ServerGone as err:
                for server in active:  # which one: ask each (a gone one answers at once, fail-fast)
                    try:
                        await self.weights.latest([server.client])
                    except ServerGone:
                        self.servers.gone(server, err)

    async def wait_for_version(self, at_least: int) -> int:
        while True:
            version = await self.newest_on_active_servers()
            if version >= at_least:
                return version
            if self.stop_requested():
                raise asyncio.CancelledError
            if self.weights.loads_to_advance and version > self.server_version:
                await self.sync_servers()  # broadcast: else the trainer never announces `at_least`
            await asyncio.sleep(POLL_SECONDS)

    async def sync_servers(self) -> None:
        """Bring every server to the newest published policy (also after a server restarted)."""
        async with self.sync_lock:
            await self._sync_servers()

    async def _sync_servers(self) -> None:
        version = await self.newest_on_active_servers()
        reviving = [s for s in self.servers.servers.values() if s.state in ("joining", "down")]
        if version < 0 and self.weights.loads_to_advance and reviving:
            # Broadcast with every server set aside: the members still in the trainer's group hold its
            # pending announcement and must load it together (revive() loads one at a time: the first
            # load would wait for the others forever). Nothing newer than what they serve: revive() does.
            announced = await self.weights.newest_announced([s.client for s in reviving])
            version = announced if announced > self.server_version else -1
        if version < 0:
            return
        # broadcast: a retired server stays in the trainer's group until it is stopped, and each member's load
        # waits for all of them: it takes the update too (else the round waits for its stop, 60 s later)
        members = ("active", "draining", "drained") if self.weights.loads_to_advance else ("active",)
        active = [s for s in self.servers.servers.values() if s.state in members]
        lost: list[WeightUpdateLost] = []  # broadcast: the trainer died before the update crossed

        async def bring(server) -> None:
            try:
                if version > 0 and await server.client.version() != version:
                    await self.weights.load(server.client, version)
            except ServerGone as err:  # revived later, on the version current then
                self.servers.gone(server, err)
            except WeightUpdateLost as err:
                lost.append(err)
            except RuntimeError:
                if not self.stop_requested():
                    raise
                # a stop while the trainer waited for this update: it will not send it (broadcast)

        loads = [asyncio.ensure_future(bring(s)) for s in active]

        async def admit(server) -> None:
            """Broadcast: a restarted or joining server the trainer admitted to its weight group takes this
            update with the others (each member's load waits for all of them), and then takes requests.
            One that does not answer yet is asked again while the others' loads last: an embedded server
            joins the group before its HTTP server is up, and the loads wait for it once it is a member."""
            while True:
                try:
                    served = await server.client.version()
                    if served == version or await self.weights.announced_to(server.client, version):
                        if served != version:
                            await self.weights.load(server.client, version)
                        if server.state in ("joining", "down"):
                            log.info("%s rejoined the weight group at policy version %d: it takes requests",
                                     server.url, version)
                            self.servers.set_active(server, version)
                    return
                except ServerGone:
                    if all(load.done() for load in loads):
                        return  # not back yet, and no load waits for it
                except WeightUpdateLost as err:
                    lost.append(err)
                    return
                except RuntimeError:
                    if not self.stop_requested():
                        raise
                    return
                await asyncio.sleep(ADMIT_RETRY_S)

        admitting: dict[str, asyncio.Future] = {}

        def admit_reviving() -> None:
            if self.weights.loads_to_advance and version > 0:
                for server in list(self.servers.servers.values()):
                    if server.state in ("joining", "down") and server.url not in admitting:
                        admitting[server.url] = asyncio.ensure_future(admit(server))

        admit_reviving()
        while self.weights.loads_to_advance and not all(load.done() for load in loads):
            # a server `scale` added may be in the trainer's new group before the supervisor lists it
            # (it joins as it starts): the loads wait for it, so it is looked for, and admitted, meanwhile
            await asyncio.sleep(ADMIT_RETRY_S)
            self.servers.reconcile()
            admit_reviving()
        await asyncio.gather(*loads, *admitting.values())
        if lost:  # the servers keep the version they had; the restarted trainer sends the next one
            log.warning("the update to policy version %d was lost with the trainer's weight sender (%s): the servers "
                        "keep version %d", version, lost[0], self.server_version)
            return
        self.server_version = version
        self.weights.retire(version)

    async def sync_if_newer(self) -> None:
        if await self.newest_on_active_servers() > self.server_version:
            await self.sync_servers()

    async def tend_servers(self) -> None:
        """All run long: follow the supervisor's server list, drain, and bring joining or restarted
        servers to the current weights before they get requests."""
        while True:
            self.servers.reconcile()
            self.servers.settle_drains()
            self.servers.write_state()  # a drain shows at once, not after the weight round in progress
            async with self.sync_lock:
                await self.servers.revive(self.server_version, self.revive_load)
                if self.weights.loads_to_advance and not self.servers.active():
                    await self._sync_servers()  # broadcast, every server set aside: admitted together
            self.servers.write_state()
            await asyncio.sleep(STATE_SECONDS)

    async def revive_load(self, client: InferenceClient, version: int) -> None:
        """Bring a server that is back (restarted, or added) to `version`. Broadcast: a vLLM server joins
        the weight group again; the trainer admits it at its next update, which the server takes in
        _sync_servers with the others (a load alone would wait for the other members forever); until
        then it serves nothing."""
        if not self.weights.loads_to_advance:
            return await self.weights.load(client, version)
        for join in self.cfg.weight_broadcast:
            if self.clients[join.endpoint] is client:
                try:
                    await client.join_weight_broadcast(join)
                except (httpx.TransportError, VllmAdminError) as err:
                    raise ServerGone(f"{join.url} did not join the weight group: {err}") from err
        raise ServerGone(f"{client.root} waits for the trainer's next update to rejoin at the current weights")

    def stop_requested(self) -> bool:
        return self.run_dir.stop_requested()

    # --- sampling --------------------------------------------------------------------------------

    async def sample(self, prompt_ids: list[int], *, n: int, temperature: float, max_tokens: int,
                     seed: int | None = None) -> CompletionResult:
        """One request, to the active servers in turn; one that is gone passes it on to another. A server
        that restarted on the base weights answers with an older policy than the one it was given: it is
        re-synced and asked again."""
        while True:
            server = await self.servers.pick()
            self.requests.enter()
            server.in_flight += 1
            try:
                response = await server.client.complete(prompt_ids, n=n, temperature=temperature,
                                                         top_p=self.cfg.top_p, max_tokens=max_tokens, seed=seed,
                                                         routed_experts=self.cfg.router_replay)
            except ServerGone as err:
                self.servers.gone(server, err)
                continue
            finally:
                server.in_flight -= 1
                self.requests.leave()
            oldest = min(c.policy_version for c in response.choices)
            if oldest >= self.server_version:
                server.answered(oldest)
                return response
            log.info("a server answered with an older policy than v%d: re-syncing it", self.server_version)
            await self.sync_servers()

    def routes_of(self, choice: SampledChoice) -> np.ndarray:
        """Router replay: a choice's routes as [fed positions, moe_layers, top_k] uint8/uint16 (the
        request's prompt, i.e. the whole transcript so far, and its completion)."""
        return sample_routes(choice.routed_experts, self.cfg.moe_layers, len(choice.prompt_token_ids),
                             len(choice.token_ids))

    def start_group(self, pool: RolloutPool, seq: int, index: int) -> None:
        """Group number `seq`, of environment number `index` (the one whose quota has room: pool.py)."""
        cfg = self.cfg
        env = self.mix.envs[index]
        if self.curriculum is not None:
            task = self.curriculum.draw(seq, index)
        else:
            task = self.mix.draw(index, seq, cfg.seed)
        work = self.runner.group(self.sample, env, task, n=cfg.group_size, temperature=cfg.temperature,
                                 seed=cfg.seed * 1_000_003 + seq * 10_007, is_useful=pool.is_useful)
        pool.start(Group(seq=seq, env=env, task=task, started_version=self.server_version, env_index=index), work)

    def group_done(self, group: Group) -> None:
        """The curriculum learns each finished group's rewards (and forgets the groups that ended without)."""
        if group.rollouts:
            self.curriculum.finished(group.seq, [r.reward for r in group.rollouts])
        else:
            self.curriculum.ended(group.seq)

    def make_batch(self, step: int, groups: list[Group], next_group: int) -> RolloutBatch:
        samples = [r.sample(g.env.id) for g in groups for r in g.rollouts]
        group_ids = [g.seq for g in groups for _ in g.rollouts]
        advantages = advantages_by_group([s.reward for s in samples], group_ids, self.cfg.normalize_advantage_std)
        for s, a in zip(samples, advantages, strict=True):
            s.advantage = a
        return RolloutBatch(step=step, samples=samples, temperature=self.cfg.temperature, next_group=next_group)

    async def evaluate(self) -> dict[str, float]:
        """The held-out greedy reward; a prompt whose rollout failed is left out and counted (failures.py)."""
        tasks = self.mix.eval_tasks(self.cfg.eval_prompts)

        async def one(env, task) -> tuple[str, float]:
            (rollout,) = await self.runner.group(self.sample, env, task, n=1, temperature=0.0)
            return self.mix.name_of(env), rollout.reward

        results = await asyncio.gather(*(one(env, t) for env, t in tasks), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        fatal = next((e for e in errors if costs_the_run(e)), None)
        if fatal is not None:
            raise fatal
        scored = [r for r in results if not isinstance(r, BaseException)]
        scores = [score for _, score in scored]
        if errors:
            log.warning("held-out eval: %d of %d rollouts failed and are left out; the first: %s", len(errors),
                        len(results), cause(errors[0]))
        if not scores:
            raise RolloutsFailing(f"held-out eval: all {len(results)} rollouts failed; the first: {cause(errors[0])}")
        return {"eval_reward": sum(scores) / len(scores), "eval_failed_rollouts": len(errors),
                "eval_policy_version": self.server_version, **self.per_environment("eval_reward", scored)}

    def per_environment(self, metric: str, scored: list[tuple[str, float]]) -> dict[str, float]:
        """`metric/<environment>`: the mean of each environment's scores, in a run of several environments
        (one environment's would repeat `metric`). An environment with no score this time has no entry."""
        if len(self.mix.names) < 2:
            return {}
        out = {}
        for name in self.mix.names:
            mine = [score for env, score in scored if env == name]
            if mine:
                out[f"{metric}/{name}"] = sum(mine) / len(mine)
        return out

    # --- the loop --------------------------------------------------------------------------------

    def first_missing_step(self) -> int:
        step = 1
        while self.run_dir.rollout(step).exists():
            step += 1
        return step

    def eval_cut_short(self, step: int) -> bool:
        """Is `step` a held-out eval step whose batch was written but whose eval row was not?"""
        cfg = self.cfg
        if not (cfg.eval_every and 0 < step < cfg.max_steps and step % cfg.eval_every == 0):
            return False
        done = read_metrics(self.run_dir.metrics, role="orchestrator") if self.run_dir.metrics.is_file() else {}
        return "eval_reward" not in done.get(step, {})

    def next_group_after(self, step: int) -> int:
        """Where the group stream continues when batch `step` is the next one to write."""
        if step == 1:
            return 0
        last = load_batch(self.run_dir.rollout(step - 1))
        return last.next_group if last.next_group is not None else (step - 1) * self.groups_per_step

    async def run(self) -> OrchestratorSummary:
        cfg = self.cfg
        started = time.monotonic()
        start = self.first_missing_step()
        if cfg.weight_broadcast:  # vLLM servers join the trainer's weight group when asked
            await asyncio.gather(*(self.clients[j.endpoint].join_weight_broadcast(j) for j in cfg.weight_broadcast))
        await self.sync_servers()
        tending = asyncio.ensure_future(self.tend_servers())
        summary_path = self.run_dir.orchestrator_state
        summary = OrchestratorSummary.read(summary_path)
        if summary.eval_reward_before is None:
            before = await self.evaluate()
            summary = summary.model_copy(update={"eval_reward_before": before["eval_reward"],
                                                 "eval_reward_before_by_env": by_environment(before)})
            self.metrics.write(0, before)
            summary.write(summary_path)
        log.info("eval reward before RL: %.4f; starting at step %d", summary.eval_reward_before, start)
        if self.eval_cut_short(start - 1):  # killed after the batch, before its eval: the curve keeps its point
            self.metrics.write(start - 1, await self.evaluate())

        pool = RolloutPool(self.groups_per_step, cfg.max_off_policy_steps, next_step=start,
                           max_failed_in_a_row=cfg.max_failed_groups_in_a_row,
                           filter_equal_rewards=cfg.filter_zero_advantage,
                           on_done=self.group_done if self.curriculum is not None else None,
                           quotas=self.mix.quotas(self.groups_per_step))
        if self.curriculum is not None and start > 1:
            saved = self.curriculum.load(self.run_dir.curriculum)
            log.info("curriculum: pass rates as of step %s (resuming at step %d): %s", saved, start,
                     self.curriculum.sizes())
        seq = self.next_group_after(start)
        last_batch_at, idle_at_last = time.monotonic(), (self.requests.seconds(), pool.idle.seconds())
        try:
            while pool.next_step <= cfg.max_steps:
                if self.stop_requested():
                    log.info("stop requested: leaving after step %d", pool.next_step - 1)
                    break
                await self.sync_if_newer()
                for index, free in enumerate(pool.open_slots_by_env(self.server_version)):
                    for _ in range(free):
                        self.start_group(pool, seq, index)
                        seq += 1
                step = pool.next_step
                groups = pool.take_batch()
                if groups is None:
                    await pool.wait(POLL_SECONDS)
                    continue
                batch = self.make_batch(step, groups, next_group=seq)
                if self.teacher is not None:
                    await self.teacher.score_all(batch.samples)
                save_batch(self.run_dir.rollout(step), batch)
                if self.curriculum is not None:
                    self.curriculum.save(self.run_dir.curriculum, step)
                now, idle = time.monotonic(), (self.requests.seconds(), pool.idle.seconds())
                self.metrics.write(step, self.step_metrics(step, groups, batch, pool, now - last_batch_at,
                                                           [a - b for a, b in zip(idle, idle_at_last, strict=True)]))
                last_batch_at, idle_at_last = now, idle
                pool.dropped = pool.failed = 0
                if cfg.eval_every and step % cfg.eval_every == 0:
                    self.metrics.write(step, await self.evaluate())
        finally:
            await pool.cancel()  # groups in no batch: a resumed run starts after the last group written

        final = await self.wait_for_version(cfg.max_steps)
        await self.sync_servers()
        served = await asyncio.gather(*(c.version() for c in self.servers.active()))
        if set(served) != {final}:  # the final eval must see the weights of the last trained step
            raise RuntimeError(f"servers serve policy versions {sorted(set(served))} after syncing to {final}")
        after = await self.evaluate()
        summary = OrchestratorSummary.model_validate({
            **summary.model_dump(), "eval_reward_after": after["eval_reward"], "eval_reward_after_step": final,
            "eval_reward_after_by_env": by_environment(after),
            "inference_engine": await self.servers.active()[0].engine(),
            "orchestrator_seconds": round(time.monotonic() - started, 2)})
        self.metrics.write(cfg.max_steps, after)
        summary.write(summary_path)
        log.info("eval reward after RL: %.4f (weights of step %d)", summary.eval_reward_after, final)
        tending.cancel()
        self.servers.write_state()
        for c in self.servers.all_clients():
            await c.close()
        if self.teacher is not None:
            await self.teacher.client.close()
        return summary

    def step_metrics(self, step: int, groups: list[Group], batch: RolloutBatch, pool: RolloutPool,
                     interval: float, idle: list[float]) -> dict:
        rollouts = [r for g in groups for r in g.rollouts]
        rewards = [s.reward for s in batch.samples]
        by_env = [(self.mix.name_of(g.env), r.reward) for g in groups for r in g.rollouts]
        mean = sum(rewards) / len(rewards)
        model_tokens = sum(r.transcript.model_tokens for r in rollouts)
        turns = [r.transcript.turns for r in rollouts]
        seconds = [r.seconds for r in rollouts]
        return {
            "reward_mean": mean,
            "reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
            "off_policy_lag": step - 1 - min(s.policy_version for s in batch.samples),
            "policy_version": self.server_version,
            "generation_seconds": interval,  # since the previous batch: the pool samples continuously
            "inference_idle_seconds": idle[0],  # of that, time with no request in flight on any server
            "rollout_idle_seconds": idle[1],  # and time with no rollout running (nothing for inference to do)
            "tokens_per_s": model_tokens / max(interval, 1e-9),
            "completion_tokens": model_tokens,
            "environment_tokens": sum(r.transcript.environment_tokens for r in rollouts),
            "turns_mean": sum(turns) / len(turns), "turns_max": max(turns),
            "rollout_seconds_mean": sum(seconds) / len(seconds), "rollout_seconds_max": max(seconds),
            "stale_groups_dropped": pool.dropped, "failed_groups": pool.failed, "groups_running": len(pool.running),
            # equal-reward groups sampled for this step and not trained on, and their share of the finished ones
            "filtered_groups": pool.filtered, "filtered_fraction": pool.filtered / (pool.filtered + len(groups)),
            "equal_reward_groups_trained": pool.equal_trained,  # > 0: the filter's budget ran out (pool.py)
            **routing_bytes(batch.samples),
            **(self.curriculum.step_metrics([g.seq for g in groups]) if self.curriculum is not None else {}),
            **self.per_environment("reward_mean", by_env),
            **self.split_metrics(groups, pool),
        }

    def split_metrics(self, groups: list[Group], pool: RolloutPool) -> dict[str, int]:
        """In a run of several environments, each one's groups in the batch (its quota: pool.py holds the
        split) and its equal-reward groups set aside for this step."""
        if len(self.mix.names) < 2:
            return {}
        out = {}
        for index, name in enumerate(self.mix.names):
            out[f"batch_groups/{name}"] = sum(g.env_index == index for g in groups)
            out[f"filtered_groups/{name}"] = pool.filtered_by_env[index]
        return out


def by_environment(evaluation: dict[str, float]) -> dict[str, float] | None:
    """An evaluate() result's per-environment rewards, by environment name (None with one environment)."""
    prefix = "eval_reward/"
    return {k.removeprefix(prefix): v for k, v in evaluation.items() if k.startswith(prefix)} or None


def run_orchestrator(config: OrchestratorConfig) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress
    orchestrator = Orchestrator(config)
    try:
        asyncio.run(orchestrator.run())
    except asyncio.CancelledError:
        log.info("stopped before the last step")
    finally:
        orchestrator.metrics.close()


def main(argv: list[str] | None = None) -> int:
    return config_main(argv, prog="python -m primebuild.runtime.orchestrator.main", config_class=OrchestratorConfig,
                       run=run_orchestrator, log_format="%(levelname)s %(message)s", failures=(RolloutsFailing,))


if __name__ == "__main__":
    from primebuild.runtime.stacks import dump_on_signal

    dump_on_signal()  # a hung run asks for this process's stacks
    raise SystemExit(main())
