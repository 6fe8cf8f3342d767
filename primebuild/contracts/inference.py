"""InferenceServerConfig: one embedded inference server (read by primebuild/runtime/inference/server.py).

vLLM servers are started by their own command line (`vllm serve …`), which is their contract.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from primebuild.contracts.base import Contract

ADMIN_TOKEN_ENV = "PRIMEBUILD_ADMIN_TOKEN"  # the run's admin token travels in this variable only
# Both engines sample a positive temperature below this at this value (vLLM 0.32's floor, `_MAX_TEMP`
# in vllm/sampling_params.py: logits / 1e-40 overflow float32); manifests may not ask for less.
MIN_SAMPLING_TEMPERATURE = 0.01
# The architectures the embedded engine's forward pass implements (primebuild/runtime/inference/model.py); the plan
# refuses any other model on engine: embedded (primebuild/builders/capabilities.py).
EMBEDDED_MODEL_TYPES = ("qwen3", "qwen3_moe")


class BroadcastJoin(Contract):
    """Join the trainer's weight broadcast group (see primebuild/runtime/inference/weight_receiver.py)."""

    init_method: str  # tcp://HOST:PORT, hosted by trainer rank 0
    rank: int = Field(ge=1)
    world_size: int = Field(ge=2)


class DisaggregationRole(Contract):
    """P/D: this server prefills (ships KV to decode servers' inboxes) or decodes (receives KV at
    tcp://host:kv_port). See primebuild/runtime/inference/disaggregation.py."""

    role: Literal["prefill", "decode"]
    kv_port: int | None = Field(None, ge=1, le=65535)  # decode: where its KV inbox listens

    @model_validator(mode="after")
    def _decode_listens(self) -> DisaggregationRole:
        if (self.role == "decode") != (self.kv_port is not None):
            raise ValueError("a decode server needs kv_port (its KV inbox); a prefill server has none")
        return self


class InferenceServerConfig(Contract):
    kind: Literal["inference"] = "inference"
    model_path: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    max_num_seqs: int = Field(ge=1)
    max_model_len: int = Field(ge=1)
    precision: Literal["fp32", "bf16", "fp8"] = "fp32"  # compute precision of the engine
    batch_invariant: bool = False  # results independent of the batch (primebuild/runtime/inference/batch_invariant.py)
    seed: int = 0
    num_threads: int | None = Field(None, ge=1)  # torch intra-op threads (CPU runs)
    policy_version: int = Field(0, ge=0)  # the version of the weights it starts with
    admin_token_env: str = ADMIN_TOKEN_ENV
    weight_broadcast: BroadcastJoin | None = None
    disaggregation: DisaggregationRole | None = None
    tool_call_parser: Literal["hermes"] | None = None  # reads tool calls from chat answers (primebuild/runtime/inference/tool_parser.py)
