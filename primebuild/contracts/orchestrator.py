"""OrchestratorConfig: what the orchestrator process needs (read by primebuild/runtime/orchestrator/main.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from primebuild.contracts.base import Contract
from primebuild.contracts.inference import MIN_SAMPLING_TEMPERATURE, BroadcastJoin
from primebuild.contracts.trackers import TrackersConfig


class EnvironmentConfig(Contract):
    id: str
    version: str | None = None  # None: whatever this primebuild provides ("latest" in the manifest)
    args: dict[str, Any] = Field(default_factory=dict)
    weight: float = Field(1.0, gt=0)  # share of each step's prompts (largest-remainder split)


class ServerJoin(BroadcastJoin):
    """One vLLM server of the trainer's weight group. Its workers (tp x dp, every engine core of the
    server) take ranks ``rank .. rank + workers - 1``; the plan lays the servers out one after another
    from rank 1 (rank 0 is the trainer's sender)."""

    url: str  # the server itself, http://HOST:PORT -- also when a P/D router is the endpoint it serves
    workers: int = Field(1, ge=1)
    endpoint: int = Field(0, ge=0)  # the index in `endpoints` whose requests reach this server


class TeacherEndpoint(Contract):
    """On-policy distillation: the teacher's server, which scores every sampled token (orchestrator/teacher.py)."""

    url: str  # OpenAI base URL (…/v1)
    served_model_name: str


CURRICULUM_POOLS = ("easy", "normal", "hard")  # by falling recent pass rate


class CurriculumConfig(Contract):
    """Prompt pools by recent pass rate (orchestrator/curriculum.py); the manifest's orchestrator.curriculum."""

    prompts: int = Field(ge=1)  # distinct training prompts per environment, drawn once from the run's seed
    window: int = Field(ge=1)  # a prompt's pass rate: mean reward of its last `window` groups
    easy_at: float  # pass rate >= easy_at: easy
    hard_at: float  # pass rate <= hard_at: hard; between: normal (and every prompt not yet sampled)
    mix: dict[Literal["easy", "normal", "hard"], float]  # each pool's share of a step's groups (weights)


class OrchestratorConfig(Contract):
    kind: Literal["orchestrator"] = "orchestrator"
    run_dir: str
    model_path: str  # its tokenizer encodes prompts and environment replies (token in, token out)
    served_model_name: str
    endpoints: list[str] = Field(min_length=1)  # OpenAI base URLs (…/v1) of the servers to sample from
    # Sampling requests in flight per endpoint at most: what its servers run at once (max_num_seqs each);
    # more would only wait in the server's queue, and cost the client (bench/RESULTS.md, P10).
    max_requests_per_endpoint: int = Field(256, ge=1)
    # vLLM with weight_sync broadcast: every server (both pools of a P/D split) is asked to join the
    # trainer's weight group (vLLM's /init_weight_transfer_engine); embedded servers join from their own config.
    weight_broadcast: list[ServerJoin] = Field(default_factory=list)
    environments: list[EnvironmentConfig] = Field(min_length=1)
    seed: int = 0

    rollouts_per_step: int = Field(ge=1)
    group_size: int = Field(ge=1)
    max_off_policy_steps: int = Field(ge=0)  # 0 = synchronous RL
    max_completion_tokens: int = Field(ge=1)  # per model turn
    seq_len: int = Field(ge=2)  # a whole rollout (prompt, model turns, environment replies) at most
    max_steps: int = Field(ge=1)
    temperature: float = Field(ge=MIN_SAMPLING_TEMPERATURE)  # sampling; evaluation is always greedy
    top_p: float = Field(1.0, gt=0, le=1)
    normalize_advantage_std: bool = False
    eval_every: int = Field(0, ge=0)  # 0 = evaluate only before and after
    eval_prompts: int = Field(ge=1)
    max_failed_groups_in_a_row: int = Field(ge=1)  # failed rollout groups are dropped; this many in a row end the run
    filter_zero_advantage: bool = True  # equal-reward groups are set aside and refilled, not trained on (pool.py)
    curriculum: CurriculumConfig | None = None  # None: prompts drawn afresh from each environment (mixture.py)

    engine: Literal["embedded", "vllm"] = "embedded"  # which API the endpoints speak (the client adapts)
    weight_sync: Literal["filesystem", "broadcast"] = "filesystem"
    keep_weights: int = Field(3, ge=1)  # filesystem sync: published weight folders kept (the newest)
    retry_seconds: float = Field(120.0, gt=0)  # how long a request rides out a restarting server
    trackers: TrackersConfig = TrackersConfig()  # metric sinks besides metrics.jsonl

    # Router replay: ask the servers for the routed experts of every sample and carry those of these
    # decoder layers (the model's MoE layers) in the rollout batch.
    router_replay: bool = False
    teacher: TeacherEndpoint | None = None  # on-policy distillation: batches carry the teacher's log-probs
    moe_layers: list[int] = Field(default_factory=list)

    @model_validator(mode="after")
    def _joins_tile_the_group(self) -> OrchestratorConfig:
        """The joins' rank blocks follow one another from rank 1 and fill the group, and every endpoint
        has a server that receives: otherwise the trainer's sender would wait for a rank nobody takes."""
        if not self.weight_broadcast:
            return self
        rank = 1
        for join in sorted(self.weight_broadcast, key=lambda j: j.rank):
            if join.rank != rank:
                raise ValueError(f"weight_broadcast: {join.url} starts at rank {join.rank}, expected {rank}")
            rank += join.workers
        worlds = {j.world_size for j in self.weight_broadcast}
        if worlds != {rank}:
            raise ValueError(f"weight_broadcast: world_size {sorted(worlds)} for ranks 0..{rank - 1}")
        served = {j.endpoint for j in self.weight_broadcast}
        if served != set(range(len(self.endpoints))):
            raise ValueError(f"weight_broadcast: joins serve endpoints {sorted(served)} of {len(self.endpoints)}")
        return self

    @model_validator(mode="after")
    def _replay_needs_layers(self) -> OrchestratorConfig:
        if self.router_replay and not self.moe_layers:
            raise ValueError("router_replay needs moe_layers (the model's MoE decoder layers)")
        return self

    @model_validator(mode="after")
    def _whole_groups(self) -> OrchestratorConfig:
        if self.rollouts_per_step % self.group_size:
            raise ValueError("rollouts_per_step must be a multiple of group_size")
        return self
