"""Prometheus text exposition (format 0.0.4) of the engine's state, written by hand: no dependency."""

from __future__ import annotations

from .engine import DECODE_BATCH_BUCKETS, Engine

PREFIX = "primebuild_inference"


def render(engine: Engine, model_name: str) -> str:
    stats = engine.stats()
    m = engine.metrics
    label = f'model="{_escape(model_name)}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float) -> None:
        lines.append(f"# HELP {PREFIX}_{name} {help_text}")
        lines.append(f"# TYPE {PREFIX}_{name} {kind}")
        lines.append(f"{PREFIX}_{name}{{{label}}} {value}")

    metric("requests_running", "gauge", "Sequences in the running batch.", stats["running"])
    metric(
        "requests_waiting", "gauge", "Requests and preempted sequences waiting for a slot.", stats["waiting"]
    )
    metric(
        "kv_cache_usage_ratio", "gauge", "Cached tokens / (max_num_seqs * max_model_len).", stats["kv_usage"]
    )
    metric("kv_cache_bytes", "gauge", "Bytes allocated for the KV cache.", stats["kv_bytes"])
    metric("policy_version", "gauge", "Version of the weights being served.", stats["policy_version"])
    metric("paused", "gauge", "1 while generation is paused by /pause.", int(stats["paused"]))
    metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", m.prompt_tokens)
    metric("generation_tokens_total", "counter", "Tokens generated.", m.generation_tokens)
    metric("sequences_finished_total", "counter", "Sequences finished.", m.requests_finished)
    metric("prefill_steps_total", "counter", "Batched prefill steps.", m.prefill_steps)
    metric("preemptions_total", "counter", "Sequences re-prefilled after a weight update.", m.preemptions)
    metric("weight_updates_total", "counter", "Weight swaps applied.", m.weight_updates)

    name = f"{PREFIX}_decode_batch_size"
    lines.append(f"# HELP {name} Sequences per decode step (continuous batching at work).")
    lines.append(f"# TYPE {name} histogram")
    cumulative = 0
    for bound, count in zip(DECODE_BATCH_BUCKETS, m.decode_batch_counts, strict=False):
        cumulative += count
        lines.append(f'{name}_bucket{{{label},le="{bound}"}} {cumulative}')
    lines.append(f'{name}_bucket{{{label},le="+Inf"}} {m.decode_steps}')
    lines.append(f"{name}_sum{{{label}}} {m.decode_batch_sum}")
    lines.append(f"{name}_count{{{label}}} {m.decode_steps}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
