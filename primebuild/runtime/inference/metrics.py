"""Prometheus text exposition (format 0.0.4) of the engine's state, written by hand: no dependency."""

from __future__ import annotations

from .disaggregation import Disaggregation
from .engine import DECODE_BATCH_BUCKETS, Engine

PREFIX = "primebuild_inference"


def render(engine: Engine, model_name: str, pd: Disaggregation | None = None) -> str:
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

    if pd is not None and (pd.prefill or pd.decode):
        # P/D: what crossed between the servers. KV bytes / tokens is the model's KV bytes per token.
        side = "sent" if pd.prefill else "received"
        c = pd.prefill.sender.counters if pd.prefill else pd.decode.inbox.counters
        metric(f"kv_transfer_{side}_total", "counter", f"Prompts whose KV cache was {side}.", c.transfers)
        metric(f"kv_transfer_{side}_bytes_total", "counter", f"Bytes of K and V {side}.", c.kv_bytes)
        metric(f"kv_transfer_{side}_tokens_total", "counter", f"Prompt tokens whose K and V were {side}.", c.tokens)
        metric(f"kv_transfer_{side}_logits_bytes_total", "counter",
               f"Bytes of last-position logits {side} beside the KV.", c.logits_bytes)
        metric(f"kv_transfer_{side}_routes_bytes_total", "counter",
               f"Bytes of the prompts' routed experts {side} beside the KV (router replay).", c.routes_bytes)
        metric(f"kv_transfer_{side}_seconds_total", "counter",
               "Seconds from KV ready to sent (prefill) or from sent to received (decode).", c.seconds)
        if pd.decode:
            metric("kv_transfer_installed_total", "counter", "Prompts continued from a shipped KV cache.",
                   m.kv_installed)
            metric("kv_transfer_stale_total", "counter", "Shipped KV caches of another policy version, prefilled "
                   "here instead.", m.kv_stale)
            metric("kv_transfer_missing_total", "counter", "Transfers that did not arrive in time, prefilled here.",
                   pd.decode.missing)

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
