"""Which environments this primebuild provides, by id and version (read by the lock and the runtime).

Built-in environments live in primebuild/runtime/envs/ and state their version there; this table is what the
lock pins without importing them (a test keeps the two equal). An id `verifiers:<taskset>` names an
installed verifiers taskset package instead.
"""

from __future__ import annotations

BUILTIN_VERSIONS: dict[str, str] = {"reverse-text": "1", "wordle": "1", "swe-tiny": "1", "long-tail": "1",
                                   "tool-lookup": "1"}
VERIFIERS_PREFIX = "verifiers:"
# Built-in environments that run a rollout's programs in a bubblewrap sandbox (primebuild/runtime/envs/sandbox.py), on
# the orchestrator's host.
SANDBOXED: frozenset[str] = frozenset({"swe-tiny"})
# args of a verifiers taskset played by the bash harness: its sandbox's limits (runtime/envs/sandbox_runtime.py
# SandboxLimits' fields)
BASH_SANDBOX_LIMITS = ("cpu_seconds", "memory_mb", "command_seconds", "wall_seconds")
