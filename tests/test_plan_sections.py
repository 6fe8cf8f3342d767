"""The plan's typed sections write the JSON keys they wrote as dicts (so plan hashes stay) and read back."""

from __future__ import annotations

from pydantic import TypeAdapter

from primebuild.contracts.estimates import Estimates, ProfileTimes, StepTimes, WeightSyncEstimate
from primebuild.contracts.memory import InferenceGroupMemory, TrainerGroupMemory
from primebuild.contracts.model_ref import ModelRef
from primebuild.contracts.plan import Plan


def _zeros(cls, **values):
    return cls(**{**dict.fromkeys(cls.model_fields, 0), **values})


def test_a_model_source_writes_only_its_own_keys_and_facts_only_when_named():
    facts = dict(total_params=10, active_params=10, architecture="Qwen3ForCausalLM", dtype="bfloat16")
    hf = ModelRef(source="hf", repo="org/m", revision="main", **facts).model_dump(mode="json")
    assert set(hf) == {"source", "repo", "revision", "dtype", "total_params", "active_params", "architecture"}
    init = ModelRef(source="init", init="random", facts="m.json", **facts).model_dump(mode="json")
    assert init["tokenizer"] is None and init["facts"] == "m.json" and "repo" not in init
    assert ModelRef.model_validate(init).model_dump(mode="json") == init


def test_estimates_without_a_roofline_step_omit_what_was_not_made():
    assert Estimates(summary=["measured"]).model_dump(mode="json") == {"summary": ["measured"]}
    profile = _zeros(ProfileTimes, sync_step_seconds=2.0)
    assert set(Estimates(summary=[], profile=profile).model_dump(mode="json")) == {"summary", "profile"}
    step = _zeros(StepTimes, idle_side="none")
    sync = _zeros(WeightSyncEstimate, mode="filesystem")
    full = Estimates(summary=[], step=step, weight_sync=sync).model_dump(mode="json")
    assert full["profile"] is None and full["suggested_split"] is None  # a roofline estimate writes every key
    assert Estimates.model_validate(full).model_dump(mode="json") == full


def test_memory_groups_read_back_as_their_own_shape():
    inference = {"role": "decode", "capacity_bytes": 8, "budget_bytes": 7, "used_bytes": 6, "free_bytes": 2,
                 "fits": True, "breakdown": {"weights": 1, "activations": 1, "overhead": 1, "kv_cache": 3,
                                           "weight_staging": 0},
                 "kv_bytes_per_token": 1, "kv_tokens_capacity": 3, "max_concurrent_seqs": 1}
    trainer = {"role": "trainer", "capacity_bytes": 8, "budget_bytes": 8, "used_bytes": 9, "free_bytes": -1,
               "fits": False, "breakdown": dict.fromkeys(("params", "grads", "optimizer_state", "master_weights",
                                                          "fsdp_buffers", "activations", "logits", "sparse_index",
                                                          "overhead"), 1),
               "host_offload_bytes_per_gpu": 0, "tokens_per_gpu": 4}
    read = TypeAdapter(Plan.model_fields["memory"].annotation).validate_python({"decode": inference, "trainer": trainer})
    assert isinstance(read["decode"], InferenceGroupMemory) and isinstance(read["trainer"], TrainerGroupMemory)
    assert {k: v.model_dump(mode="json") for k, v in read.items()} == {"decode": inference, "trainer": trainer}
