"""TrainerConfig: everything one trainer process needs (read by primebuild/runtime/trainer/main.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from primebuild.contracts.base import Contract
from primebuild.contracts.inference import MIN_SAMPLING_TEMPERATURE
from primebuild.contracts.loss import DppoKl, LossConfig
from primebuild.contracts.trackers import TrackersConfig

Precision = Literal["fp32", "bf16", "fp8"]


class FilesystemSync(Contract):
    """Publish `weights/step_k/` folders (HF layout, STABLE marker) that the servers load."""

    mode: Literal["filesystem"] = "filesystem"


# Staging per receiving worker is two buckets (primebuild/runtime/weight_sync/broadcast.py): 2 GiB on a GPU,
# beside the 14 GiB vLLM leaves outside its budget at gpu_memory_utilization 0.9 on an H200.
DEFAULT_BUCKET_MB = 1024.0


class BroadcastSync(Contract):
    """Rank 0 sends every step over a torch.distributed group it hosts at `init_method`."""

    mode: Literal["broadcast"] = "broadcast"
    init_method: str  # tcp://HOST:PORT
    world_size: int = Field(ge=2)  # 1 sender + the inference servers
    timeout_s: float = Field(600.0, gt=0)
    bucket_mb: float = Field(DEFAULT_BUCKET_MB, gt=0)  # the tensors travel in buckets of about this size
    delta: bool = False  # only the elements that changed since the previous sync (weight_sync/delta.py)
    # FP8 servers (inference.precision: fp8, the embedded engine): the matmul weights cross already in the
    # serving format, quantised from the weights rounded to this dtype as the servers would (weight_sync/fp8_wire.py)
    fp8_served_dtype: Literal["float32", "bfloat16"] | None = None


WeightSyncConfig = Annotated[FilesystemSync | BroadcastSync, Field(discriminator="mode")]


class ParallelDims(Contract):
    """The manifest's parallel degrees; the trainer checks them against its launch (world size)."""

    dp_replicate: int = Field(1, ge=1)
    dp_shard: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp


class LoraConfig(Contract):
    """Low-rank adapters on the named linear modules (primebuild/runtime/trainer/lora.py); the base stays frozen."""

    rank: int = Field(ge=1)
    alpha: float = Field(gt=0)
    targets: list[str] = Field(min_length=1)


class TrainerConfig(Contract):
    kind: Literal["trainer"] = "trainer"
    model_path: str  # HF folder (config.json, safetensors, tokenizer files)
    run_dir: str
    seed: int = 0
    resume: bool = True  # continue after the newest stable checkpoint of the run, if any
    trackers: TrackersConfig = TrackersConfig()  # metric sinks besides metrics.jsonl

    # Objective
    loss: LossConfig = DppoKl()  # the manifest's orchestrator.loss, unchanged (contracts/loss.py)
    loss_normalizer: Literal["step_tokens", "samples_x_max_tokens"] = "step_tokens"
    # On-policy distillation: weight of the per-token reverse KL to the teacher, subtracted from each token's
    # advantage (runtime/trainer/distill.py); batches then carry teacher_logprobs. 0: no teacher.
    distill_weight: float = Field(0.0, ge=0)
    max_completion_tokens: int = Field(ge=1)  # for samples_x_max_tokens
    temperature: float = Field(ge=MIN_SAMPLING_TEMPERATURE)  # the sampling temperature: logits are divided by it

    # Optimisation (the lr is linear warm-up then constant: step k uses lr * min(1, k / warmup))
    optimizer: Literal["adamw"] = "adamw"
    lr: float = Field(gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)
    max_steps: int = Field(ge=1)

    # Execution
    # whose model code computes: torchtitan's modules (runtime/trainer/titan_model.py) or transformers'
    # eager layers; the plan chooses (builders/trainer_engine.py), a hand-written config may say either
    engine: Literal["torchtitan", "hf"] = "hf"
    micro_batch_tokens: int = Field(ge=1)  # tokens of one packed micro-batch (runtime/trainer/batch.py)
    logprob_chunk_tokens: int = Field(ge=1)  # tokens whose fp32 logits exist at once (primebuild/kernels/logprobs.py)
    precision: Precision = "fp32"  # compute precision; master weights and Adam state stay fp32
    # Replay the experts inference routed each token to (a batch carries them when the orchestrator asks),
    # and every `replay_check_every` steps (0: never) also score the batch without replay, no gradient,
    # to log the mismatch KL that replay removes.
    router_replay: bool = False
    replay_check_every: int = Field(1, ge=0)
    activation_checkpointing: bool = False
    parallel: ParallelDims = ParallelDims()
    optimizer_cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: shards, grads, optimizer state on the host
    lora: LoraConfig | None = None  # train adapters only; checkpoints and published weights hold only them
    pad_token_id: int = 0  # any id works: padding (a CP split's tail) is a document of its own, without loss

    # Rollout intake
    rollout_timeout_s: float = Field(3600.0, gt=0)  # give up when step k's batch does not arrive
    poll_interval_s: float = Field(0.01, gt=0)  # a new batch is a file: noticing it late idles the trainer

    # Weights out
    weight_sync: WeightSyncConfig = FilesystemSync()
    weight_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # of published weights: model.dtype

    # Checkpoints
    checkpoint_every: int = Field(0, ge=0)  # 0 = only at the end of the run
    keep_checkpoints: int | None = Field(None, ge=1)  # None: every checkpoint

