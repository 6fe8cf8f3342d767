"""The trainer process: one optimizer step per rollout batch, new weights published after each.

    python -m primebuild.runtime.trainer.main --config trainer.json                  # one process
    torchrun --nproc_per_node=N -m primebuild.runtime.trainer.main --config trainer.json

Loop for k = 1, 2, ... (steps are 1-based; see batch.py for the file contract):
  1. wait for ``<run_dir>/rollouts/step_{k:06d}.pt`` — rank 0 polls and tells the others, so all ranks
     agree; a ``<run_dir>/STOP`` file ends the run before step k, ``max_steps`` after it, and
     ``rollout_timeout_s`` without a batch is an error;
  2. every rank loads the whole batch, packs it the same way and takes its own micro-batches; losses are
     sums divided by one constant of the step, so the gradient does not depend on the number of ranks;
  3. clip the gradient norm, AdamW step (linear warm-up of the lr);
  4. publish the weights: ``weights/step_{k:06d}/`` in HF layout (filesystem) or a broadcast to the
     inference workers (broadcast);
  5. every ``checkpoint_every`` steps, and when the run ends, save ``checkpoints/step_{k:06d}/``; then
     append metrics to ``<run_dir>/metrics.jsonl``; with ``resume`` the run continues after the newest one.

Metrics (one JSON line each, see primebuild/runtime/metrics.py), means are over trained tokens of the whole step:
  loss, behaviour_kl (KL(inference ‖ trainer) over all tokens, see losses.py), mismatch_kl (the same over
  samples drawn with exactly the weights being trained: engine numerics only), masked_fraction, importance_ratio, entropy,
  grad_norm (before clipping), lr, tokens, samples, reward_mean, advantage_abs_mean, async_lag_mean/max
  (k − 1 − policy_version of a sample: how many optimizer steps behind its sampler was),
  padding_fraction, teacher_kl (distillation: the reverse KL to the teacher, distill.py),
  wait_s, step_s, publish_s;
  with router replay (router_replay.py) also behaviour_kl_no_replay and mismatch_kl_no_replay (the same
  tokens scored once more without replay, no gradient, every ``replay_check_every`` steps: one extra
  forward per micro-batch, its seconds in replay_check_s) and routing_agreement (replayed routes the
  trainer's router chose itself).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from primebuild.contracts.dtypes import PRECISION_DTYPES
from primebuild.contracts.run_dir import RunDir
from primebuild.contracts.trainer import ParallelDims, TrainerConfig
from primebuild.errors import UserError
from primebuild.kernels.dtypes import DTYPES
from primebuild.runtime.config_main import config_main
from primebuild.runtime.weight_sync import filesystem as fs

from ..metrics import MetricsWriter
from ..rollout_file import load_batch
from ..trackers import open_sinks
from . import finite
from .batch import loss_normalizer, pack, pad_columns
from .checkpoint import load_checkpoint, save_checkpoint
from .compile_off import off_unless_cuda
from .context_parallel import make_shard, padded_length
from .distill import distilled_advantages, reverse_kl_per_token, teacher_baseline
from .lora import trainable_parameters
from .lora_publish import AdapterPublisher
from .losses import kl_per_token, resolve_loss
from .model import (
    DistEnv,
    autocast_context,
    init_distributed,
    load_model,
    precision_dtype,
)
from .parallel_dims import Meshes, build_meshes, check_dims
from .step_sums import StepSums
from .teardown import ProcessGroups
from .weight_stream import PublishedWeights

__all__ = ["TrainerConfig", "run_trainer", "main"]

log = logging.getLogger("primebuild.trainer")

_STOP, _READY, _TIMEOUT = 0, 1, 2


def wait_for_batch(config: TrainerConfig, step: int, env: DistEnv) -> Path | None:
    """Rank 0 polls the file system and broadcasts its verdict, so no two ranks ever disagree."""
    run = RunDir(config.run_dir)
    path = run.rollout(step)
    verdict = _READY
    if env.is_main:
        deadline = time.monotonic() + config.rollout_timeout_s
        while True:
            if run.stop_requested():
                verdict = _STOP
                break
            if path.exists():
                break
            if time.monotonic() >= deadline:
                verdict = _TIMEOUT
                break
            time.sleep(config.poll_interval_s)
    if env.distributed:
        flag = torch.tensor([verdict], dtype=torch.int64, device=env.device)
        dist.broadcast(flag, src=0)
        verdict = int(flag.item())
    if verdict == _TIMEOUT:
        raise TimeoutError(
            f"no rollout batch {path} after {config.rollout_timeout_s:.0f}s; is the orchestrator running? "
            f"(create {run.stop_file} to end a run cleanly)"
        )
    return path if verdict == _READY else None


def lr_at(config: TrainerConfig, step: int) -> float:
    if config.warmup_steps <= 0:
        return config.lr
    return config.lr * min(1.0, step / config.warmup_steps)


def _grad_norm(model: torch.nn.Module, max_norm: float, env: DistEnv, meshes: Meshes) -> torch.Tensor:
    """Clip to `max_norm` (as clip_grad_norm_ does) and return the norm before clipping.

    With several ranks every element of every gradient lives on exactly one rank of a replica (FSDP
    shards, EP owns whole experts; HSDP's replicas hold the same reduced gradients; what TP replicates is
    counted once: _tp_copies), so the global norm is one all-reduce of local sums of squares over the
    replica; clip_grad_norm_ cannot stack DTensors of different meshes (EP's experts vs the rest)."""
    if not env.distributed:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    _reduce_partial_grads(model)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    squares = torch.stack([finite.local(g).detach().double().pow(2).sum() / _tp_copies(g) for g in grads]).sum()
    dist.all_reduce(squares, group=meshes.replica_group)
    norm = squares.sqrt().float()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        finite.local(g).mul_(scale.to(g.dtype))
    return norm


def _reduce_partial_grads(model: torch.nn.Module) -> None:
    """Under TP a weight replicated over the TP group but applied to head- or sequence-split activations
    (the norms) ends backward with a partial gradient on each rank (DTensor's Partial): sum it now, so
    the norm and the optimizer see the whole gradient."""
    from torch.distributed.tensor import Replicate

    for p in model.parameters():
        g = p.grad
        if g is not None and any(pl.is_partial() for pl in getattr(g, "placements", ())):
            p.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])


def _tp_copies(grad: torch.Tensor) -> int:
    """How many ranks of a TP group hold this same gradient (a norm weight is replicated over tp; a
    column of a TP-sharded matrix is not): the norm's all-reduce would count it that many times."""
    mesh = getattr(grad, "device_mesh", None)
    if mesh is None:
        return 1
    copies = 1
    for i, placement in enumerate(grad.placements):
        if placement.is_replicate() and mesh.mesh_dim_names and mesh.mesh_dim_names[i] == "tp":
            copies *= mesh.size(i)
    return copies


def fresh_mask(mb, samples, mask: torch.Tensor, step: int, device) -> torch.Tensor:
    """Trained tokens of samples drawn with exactly the weights being trained (policy version step-1)."""
    if mb.is_empty:
        return torch.zeros_like(mask)
    fresh = torch.tensor([samples[i].policy_version == step - 1 for i in mb.sample_indices] + [False],
                         dtype=torch.bool, device=device)
    return mask & fresh[mb.document_ids.to(device)]  # document -1 (padding) reads the appended False


def place(mb, config: TrainerConfig, env: DistEnv, meshes: Meshes):
    """`mb` on the device, and what this rank computes of it: (mb, CP shard or None, loss mask, routes).

    With context parallelism the micro-batch is padded to equal chunks and this rank scores only the
    tokens of its own positions (the other CP ranks score the rest); its recorded routes are those of
    the positions it computes, in the order the model sees them. With EP beside TP the rows a rank
    computes are padded to a multiple of tp: torchtitan's MoE splits them along the sequence over TP
    and pads its own copy to equal parts, which then no longer adds to the block's residual."""
    shard = None
    dims, length = meshes.dims, mb.input_ids.shape[1]
    multiple = (padded_length(1, dims.cp) if dims.cp > 1 else 1) * (dims.tp if dims.tp > 1 and dims.ep > 1 else 1)
    if length % multiple:
        mb = pad_columns(mb, -(-length // multiple) * multiple, config.pad_token_id)
    if dims.cp > 1:
        shard = make_shard(mb.document_ids[0], meshes.dims.cp, dist.get_rank(meshes.cp_group), meshes.cp_group,
                           env.device)
    mb.input_ids = mb.input_ids.to(env.device)
    mb.position_ids = mb.position_ids.to(env.device)
    mask = mb.loss_mask.to(env.device)
    routes = mb.routed_experts.to(env.device) if mb.routed_experts is not None else None
    if shard is not None:
        mask = mask & torch.zeros_like(mask).index_fill_(1, shard.targets, True)
        if routes is not None:
            routes = routes[:, shard.positions]
    return mb, shard, mask, routes


@torch.no_grad()
def score_without_replay(model, mb, shard, mask, samples, config: TrainerConfig, env: DistEnv,
                         step: int) -> torch.Tensor:
    """(KL sum over trained tokens, over fresh ones) of micro-batch `mb` scored with the trainer's own
    routing: the mismatch router replay removes."""
    with autocast_context(env, compute_dtype(config, env.device)):
        lp, _ = model(mb.input_ids, mb.position_ids, config.temperature, shard)
    kl = kl_per_token(lp - mb.inference_logprobs.to(env.device))
    fresh = fresh_mask(mb, samples, mask, step, env.device)
    return torch.stack([torch.where(mask, kl, 0.0).sum(), torch.where(fresh, kl, 0.0).sum()]).double().cpu()


def train_step(model, optimizer, batch, config: TrainerConfig, loss_fn, env: DistEnv, step: int,
               meshes: Meshes | None = None) -> dict:
    """One optimizer step on ``batch``; returns the step's metrics (identical on every rank).

    Micro-batches are dealt over the dp ranks (dp_replicate * dp_shard); the CP ranks of a dp rank share its micro-batches and
    split each one's sequence (context_parallel.py), each scoring the tokens of its own positions."""
    _check_temperature(batch.temperature, config, step)
    samples = batch.samples
    normalizer = loss_normalizer(samples, config.loss_normalizer, config.max_completion_tokens)
    meshes = meshes or build_meshes(ParallelDims(dp_shard=env.world_size), env.world_size, env.rank,
                                    env.device.type)
    mine = [place(mb, config, env, meshes) for mb in
            pack(samples, config.micro_batch_tokens, meshes.dp_degree, config.pad_token_id)[meshes.dp_rank]]
    replayed = model.replay is not None and any(s.routed_experts is not None for s in samples)
    # The same on every rank (FSDP collectives must match): score the batch once more without replay.
    check = replayed and config.replay_check_every > 0 and step % config.replay_check_every == 0

    started = time.perf_counter()
    # Before any backward: under FSDP2 a forward between micro-batches' backwards corrupted the gradients
    # (measured: 2 ranks gave grad_norm 0.49 where 1 rank gave 0.77; with the forwards first, equal).
    free = [score_without_replay(model, mb, shard, mask, samples, config, env, step) if check
            else torch.zeros(2, dtype=torch.float64) for mb, shard, mask, _ in mine]
    check_seconds = time.perf_counter() - started
    totals, bad_loss = _backward_micro_batches(model, mine, free, samples, config, loss_fn, env, step,
                                               normalizer, replayed)
    sums = StepSums.from_tensor(_sum_over_ranks(totals, env, meshes.dims.tp))
    grad_norm, lr = _optimizer_step(model, optimizer, config, env, meshes, step, bad_loss)
    metrics = _step_metrics(sums, samples, normalizer, step, grad_norm.item(), lr)
    if replayed:
        metrics.update(_replay_metrics(sums, check, check_seconds))
    return metrics


def _check_temperature(temperature: float | None, config: TrainerConfig, step: int) -> None:
    if temperature is not None and abs(temperature - config.temperature) > 1e-9:
        raise UserError(
            f"rollouts for step {step} were sampled at temperature {temperature}, the trainer scores at "
            f"{config.temperature}",
            hint="set trainer temperature to the sampling temperature, or log-probs will not match",
        )


def _backward_micro_batches(model, mine, free, samples, config: TrainerConfig, loss_fn, env: DistEnv,
                            step: int, normalizer: float, replayed: bool) -> tuple[torch.Tensor, str | None]:
    """Forward and backward of this rank's micro-batches; returns their StepSums, packed, and where the
    first non-finite loss was (None when every loss was finite)."""
    replay = model.replay
    totals = torch.zeros(StepSums.size(), dtype=torch.float64)  # StepSums of this rank, packed
    bad_loss = None
    baseline = teacher_baseline(samples) if config.distill_weight else 0.0  # the whole step's (distill.py)
    for (mb, shard, mask, routes), free_kl in zip(mine, free, strict=True):
        own = slice(None) if shard is None else shard.positions.cpu()  # the columns this rank computes
        inference_lp = mb.inference_logprobs.to(env.device)
        fresh = fresh_mask(mb, samples, mask, step, env.device)
        # Routes stay set through backward: activation checkpointing recomputes the routers there.
        with replay.replaying(routes if replayed else None) if replay is not None else contextlib.nullcontext():
            with autocast_context(env, compute_dtype(config, env.device)):
                lp, entropy = model(mb.input_ids, mb.position_ids, config.temperature, shard)
            advantages, teacher_kl, teacher_tokens = _advantages(mb, inference_lp, mask, config, env, baseline)
            loss_sum, m = loss_fn(lp, inference_lp, advantages, mask)
            if bad_loss is None and not torch.isfinite(loss_sum).item():
                bad_loss = f"of samples {mb.sample_indices[0]}..{mb.sample_indices[-1]}" if mb.sample_indices else ""
            # The hf engine's FSDP2 averages gradients over ranks (HSDP: over the shard and the replicate
            # dimension); scaling by world_size turns that back into the sum that one rank holding every
            # micro-batch would compute. The torchtitan engine's FSDP sums them already.
            spread = 1 if model.sums_gradients else env.world_size
            (loss_sum * (spread / normalizer)).backward()
        agreed, replayed_routes = replay.take_agreement() if replay is not None else (0.0, 0.0)
        totals += StepSums(
            loss=loss_sum, tokens=m["tokens"], kl=m["mismatch_kl"], masked=m["masked"], ratio=m["ratio"],
            entropy=torch.where(mask, entropy, 0.0).sum(),
            real=0.0 if mb.is_empty else float(mb.real_tokens[:, own].sum()),
            padded=0.0 if mb.is_empty else float(mb.real_tokens[:, own].numel()),
            fresh_tokens=fresh.sum(), fresh_kl=torch.where(fresh, kl_per_token(lp - inference_lp), 0.0).sum(),
            kl_no_replay=free_kl[0], fresh_kl_no_replay=free_kl[1], agreed_routes=agreed,
            replayed_routes=replayed_routes, teacher_kl=teacher_kl, teacher_tokens=teacher_tokens,
        ).to_tensor()
    return totals, bad_loss


def _advantages(mb, inference_lp, mask, config: TrainerConfig, env: DistEnv, baseline: float):
    """The micro-batch's per-token advantages, with the distillation penalty when the batch has a teacher
    (distill.py, `baseline` its k̄); also the reverse-KL sum and count over the trained tokens the teacher
    scored, for the teacher_kl metric."""
    advantages = mb.advantages.to(env.device)
    if mb.teacher_logprobs is None:
        return advantages, 0.0, 0.0
    teacher_lp = mb.teacher_logprobs.to(env.device)
    scored = mask & ~torch.isnan(teacher_lp)
    kl = torch.where(scored, reverse_kl_per_token(inference_lp, teacher_lp), 0.0).sum()
    if config.distill_weight:
        advantages = distilled_advantages(advantages, inference_lp, teacher_lp, config.distill_weight, baseline)
    return advantages, kl, scored.sum()


def _sum_over_ranks(totals: torch.Tensor, env: DistEnv, tp: int = 1) -> torch.Tensor:
    """The step's sums over every rank; the `tp` ranks of a TP group computed the same micro-batches,
    so each holds 1/tp of them (exact: tp is a power of two in practice, and a float division by it
    rounds nothing)."""
    if not env.distributed:
        return totals
    t = (totals / tp).to(env.device)
    dist.all_reduce(t)
    return t.cpu()


def _optimizer_step(model, optimizer, config: TrainerConfig, env: DistEnv, meshes: Meshes, step: int,
                    bad_loss: str | None) -> tuple[torch.Tensor, float]:
    """Refuse non-finite losses and gradients, clip, step at this step's learning rate; returns the
    gradient norm before clipping and the learning rate."""
    finite.check(step, bad_loss, "the loss", env.device)
    finite.check(step, finite.first_non_finite(finite.grads(model)), "the gradient of", env.device)
    grad_norm = _grad_norm(model, config.max_grad_norm, env, meshes)
    lr = lr_at(config, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    finite.check(step, finite.first_non_finite(finite.weights(model)), "the updated weight", env.device)
    return grad_norm, lr


def _step_metrics(sums: StepSums, samples, normalizer: float, step: int, grad_norm: float, lr: float) -> dict:
    n_tok = max(sums.tokens, 1.0)
    lags = [step - 1 - s.policy_version for s in samples]
    return {
        "loss": sums.loss / normalizer,
        # KL(inference ‖ trainer) over every token: engine numerics plus the staleness of async samples
        "behaviour_kl": sums.kl / n_tok,
        # the same over samples drawn with the very weights being trained: engine vs trainer numerics only
        # (NaN -> null in metrics.jsonl when the whole batch is stale, as in steady-state async RL)
        "mismatch_kl": sums.fresh_kl / sums.fresh_tokens if sums.fresh_tokens else float("nan"),
        "masked_fraction": sums.masked / n_tok,
        "importance_ratio": sums.ratio / n_tok,
        "entropy": sums.entropy / n_tok,
        "grad_norm": grad_norm,
        "lr": lr,
        "tokens": sums.tokens,
        "samples": len(samples),
        "reward_mean": sum(s.reward for s in samples) / max(1, len(samples)),
        "advantage_abs_mean": sum(abs(s.advantage) for s in samples) / max(1, len(samples)),
        "async_lag_mean": sum(lags) / max(1, len(lags)),
        "async_lag_max": max(lags, default=0),
        "padding_fraction": 1.0 - sums.real / sums.padded if sums.padded else 0.0,
        # on-policy distillation: mean μ − τ over the trained tokens the teacher scored (the reverse KL to it)
        **({"teacher_kl": sums.teacher_kl / sums.teacher_tokens} if sums.teacher_tokens else {}),
    }


def _replay_metrics(sums: StepSums, check: bool, check_seconds: float) -> dict:
    """KLs as if the trainer had not replayed the routes (NaN -> null when not measured this step), and
    how many of the replayed routes the trainer's own router would have chosen."""
    n_tok = max(sums.tokens, 1.0)
    return {
        "behaviour_kl_no_replay": sums.kl_no_replay / n_tok if check else float("nan"),
        "mismatch_kl_no_replay": sums.fresh_kl_no_replay / sums.fresh_tokens if check and sums.fresh_tokens
        else float("nan"),
        "routing_agreement": sums.agreed_routes / sums.replayed_routes if sums.replayed_routes else float("nan"),
        "replay_check_s": check_seconds,  # this rank's time in the forward without replay (in step_s)
    }


class WeightPublisher:
    """Filesystem: ``weights/step_k`` folders. Broadcast: rank 0 sends to the inference workers."""

    def __init__(self, config: TrainerConfig, env: DistEnv):
        self.config, self.env = config, env
        self.weights_dir = RunDir(config.run_dir).weights
        self.sender = None
        self.weights: PublishedWeights | None = None
        self.adapter = AdapterPublisher(config, env) if config.lora is not None else None
        sync = config.weight_sync
        if sync.mode == "broadcast" and env.is_main:
            from primebuild.runtime.weight_sync.broadcast import BroadcastSender

            self.sender = BroadcastSender(
                sync.init_method,
                sync.world_size,
                backend="nccl" if env.device.type == "cuda" else "gloo",
                timeout_s=sync.timeout_s,
                device=env.device,
                bucket_mb=sync.bucket_mb,
                delta=sync.delta,
            )

    def publish(self, model, step: int) -> None:
        """With LoRA only the adapter is published (lora_publish.py). Otherwise: stream the full weights a layer at a time (weight_stream.py): every rank takes part in the
        gathers, rank 0 writes or sends each layer as it comes, so no rank holds the whole model."""
        if self.adapter is not None:
            self.adapter.publish(model, step)
            return
        if self.weights is None:  # names and shapes do not change from step to step
            self.weights = model.published_weights(DTYPES[self.config.weight_dtype])
            served = getattr(self.config.weight_sync, "fp8_served_dtype", None)
            if served is not None and self.sender is not None:  # FP8 servers: the serving format crosses
                from primebuild.runtime.weight_sync.fp8_wire import Fp8Wire

                self.weights = Fp8Wire(self.weights, DTYPES[served])
        if not self.env.is_main:
            self.weights.drain()
        elif self.sender is not None and step <= self.sender.servers_hold:
            # a trainer restarted alone retrains the steps after its checkpoint: the servers hold these
            # very bytes already (same checkpoint, same rollout batches), so the first step sent is the next
            self.weights.drain()
            log.info("step %d: the inference servers hold it already (loaded before the trainer restarted): "
                     "not sent again", step)
        elif self.sender is not None:
            # the servers take a step inside their update: a stopped run's orchestrator starts none
            if self.sender.send(self.weights, step, cancelled=RunDir(self.config.run_dir).stop_requested) is None:
                log.info("stop requested while step %d waited for the servers: not sent", step)
        else:
            fs.publish_hf_weights(self.weights_dir, step, self.weights, model.config, self.config.model_path)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


def compute_dtype(config: TrainerConfig, device: torch.device | None = None) -> str:
    if config.precision not in (*PRECISION_DTYPES, "fp8"):
        raise UserError(f"trainer precision {config.precision}: this trainer computes in fp32, bf16 or fp8")
    return precision_dtype(config.precision, device or torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def check_launch(config: TrainerConfig, env: DistEnv) -> None:
    """What the plan's capability check refuses, refused again here: a hand-written config is no way round."""
    check_dims(config.parallel, env.world_size)
    if config.parallel.tp > 1 and config.engine != "torchtitan":
        raise UserError(f"parallel tp={config.parallel.tp}: tensor parallelism is torchtitan's Qwen3 plan, applied "
                        "on the torchtitan engine only", hint="set engine: torchtitan, or tp: 1")
    if config.lora is not None and config.weight_sync.mode != "filesystem":
        raise UserError("LoRA publishes adapter folders: it needs filesystem weight sync")
    if config.optimizer_cpu_offload and env.world_size < 2:
        raise UserError("optimizer_cpu_offload needs FSDP: at least 2 trainer ranks")
    compute_dtype(config)


def resume(ckpt_dir: Path, model, optimizer, env: DistEnv) -> int:
    """The step after the newest checkpoint that verifies (damaged ones are named and skipped), or 1."""
    warn = log.warning if env.is_main else (lambda _: None)
    latest = fs.latest_verified(ckpt_dir, warn=warn)
    if latest is None:
        if fs.step_folders(ckpt_dir):
            raise UserError(f"{ckpt_dir}: no checkpoint verifies (see the warnings above)",
                            hint="restore a checkpoint, or remove the folder to start the run over")
        if env.is_main:
            log.info("resume: no checkpoint under %s, starting at step 1", ckpt_dir)
        return 1
    step = load_checkpoint(latest[1], model, optimizer)
    log.info("resumed from %s; next step %d", latest[1], step + 1)
    return step + 1


def run_trainer(config: TrainerConfig) -> None:
    env = init_distributed()
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s [trainer rank {env.rank}] %(message)s")
    groups = ProcessGroups()
    finished = False
    try:
        check_launch(config, env)
        torch.manual_seed(config.seed)
        run = RunDir(config.run_dir)
        if env.is_main:
            run.root.mkdir(parents=True, exist_ok=True)
        meshes = build_meshes(config.parallel, env.world_size, env.rank, env.device.type)
        groups.track(meshes.world)
        _train(config, env, run, meshes, groups)
        finished = True
    finally:
        # after _train returned: the model, its FSDP state and the optimizer hold groups too, and are gone
        groups.close(finished, default_group=env.distributed)


def _train(config: TrainerConfig, env: DistEnv, run: RunDir, meshes: Meshes, groups: ProcessGroups) -> None:
    loss_fn = resolve_loss(config.loss)
    if config.engine == "torchtitan":
        off_unless_cuda(env.device)
        from .titan_policy import load_titan_model

        model = load_titan_model(config.model_path, env, compute_dtype(config, env.device),
                                 config.activation_checkpointing, config.logprob_chunk_tokens, config.parallel,
                                 cpu_offload=config.optimizer_cpu_offload, router_replay=config.router_replay,
                                 fp8=config.precision == "fp8", lora=config.lora, seed=config.seed)
        groups.track(model.world_mesh)
    else:
        model = load_model(config.model_path, env, compute_dtype(config, env.device), config.activation_checkpointing,
                           config.logprob_chunk_tokens, config.router_replay, fp8=config.precision == "fp8",
                           meshes=meshes, cpu_offload=config.optimizer_cpu_offload, lora=config.lora,
                           seed=config.seed)
    optimizer = torch.optim.AdamW(  # with LoRA the adapters only: the frozen base has no optimizer state
        trainable_parameters(model), lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
    )
    ckpt_dir = run.checkpoints
    start = 1
    if config.resume:
        start = resume(ckpt_dir, model, optimizer, env)
    sinks = open_sinks(config.trackers, run, "trainer") if env.is_main else []
    metrics = MetricsWriter(run.metrics, enabled=env.is_main, sinks=sinks)
    publisher = WeightPublisher(config, env)
    last_done, last_saved = start - 1, start - 1
    try:
        for step in range(start, config.max_steps + 1):
            t0 = time.monotonic()
            path = wait_for_batch(config, step, env)
            if path is None:
                log.info("STOP file found before step %d; stopping", step)
                break
            t1 = time.monotonic()
            stats = train_step(model, optimizer, load_batch(path), config, loss_fn, env, step, meshes)
            t2 = time.monotonic()
            publisher.publish(model, step)
            stats.update(wait_s=t1 - t0, step_s=t2 - t1, publish_s=time.monotonic() - t2)
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                save_checkpoint(ckpt_dir, step, model, optimizer, env, config.keep_checkpoints)
                last_saved = step
            # after its checkpoint: a crash in between (a host cut off mid-save) leaves no row of a step
            # that `--resume` trains again, so every step is in metrics.jsonl once
            metrics.write(step, stats)
            last_done = step
            if env.is_main:
                log.info(
                    "step %d loss %.4g behaviour_kl %.3g mismatch_kl %.3g grad_norm %.3g%s",
                    step,
                    stats["loss"],
                    stats["behaviour_kl"],
                    stats["mismatch_kl"],
                    stats["grad_norm"],
                    f" (no replay: behaviour_kl {stats['behaviour_kl_no_replay']:.3g} mismatch_kl "
                    f"{stats['mismatch_kl_no_replay']:.3g})" if "behaviour_kl_no_replay" in stats else "",
                )
        if last_done > last_saved:  # the end of a run is always resumable
            save_checkpoint(ckpt_dir, last_done, model, optimizer, env, config.keep_checkpoints)
    finally:
        metrics.close()
        publisher.close()


def main(argv: list[str] | None = None) -> int:
    # run_trainer sets up logging: its lines name the rank, known only once the process group is up
    return config_main(argv, prog="python -m primebuild.runtime.trainer.main", config_class=TrainerConfig,
                       run=run_trainer, log_format=None, failures=(finite.NonFiniteStep,))


if __name__ == "__main__":
    from primebuild.runtime.stacks import dump_on_signal

    dump_on_signal()  # a hung run asks for this process's stacks
    sys.exit(main())
