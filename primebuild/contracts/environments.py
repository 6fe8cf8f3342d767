"""Which environments this primebuild provides, by id and version (read by the lock and the runtime).

Built-in environments live in primebuild/runtime/envs/ and state their version there; this table is what the
lock pins without importing them (a test keeps the two equal). An id `verifiers:<taskset>` names an
installed verifiers taskset package instead.
"""

from __future__ import annotations

BUILTIN_VERSIONS: dict[str, str] = {"reverse-text": "1", "wordle": "1", "swe-tiny": "1", "long-tail": "1",
                                   "tool-lookup": "1"}
# Each built-in environment's args (its constructor's parameters), so the plan refuses an unknown one without
# importing the environments (the same test keeps this equal to the constructors).
BUILTIN_ARGS: dict[str, tuple[str, ...]] = {
    "reverse-text": ("min_length", "max_length", "num_eval"),
    "wordle": ("word_length", "alphabet", "max_guesses", "num_eval"),
    "swe-tiny": ("max_turns", "cpu_seconds", "wall_seconds", "memory_mb", "hostile", "reply_chars"),
    "long-tail": ("turns_p50", "turns_p99", "latency_p50_s", "latency_p99_s", "max_turns", "min_length", "max_length",
                  "num_eval"),
    "tool-lookup": ("key_length", "value_length", "alphabet", "max_turns", "num_eval", "max_tokens_per_turn"),
}
VERIFIERS_PREFIX = "verifiers:"
# Built-in environments that run a rollout's programs in a bubblewrap sandbox (primebuild/runtime/envs/sandbox.py), on
# the orchestrator's host.
SANDBOXED: frozenset[str] = frozenset({"swe-tiny"})
# args of a verifiers taskset played by the bash harness: its sandbox's limits (runtime/envs/sandbox_runtime.py
# SandboxLimits' fields)
BASH_SANDBOX_LIMITS = ("cpu_seconds", "memory_mb", "command_seconds", "wall_seconds")
