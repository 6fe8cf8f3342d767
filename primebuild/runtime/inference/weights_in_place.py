"""New weights installed into the served ones piece by piece as their tensors arrive (a bucketed weight
broadcast), so an update holds one piece besides the served model, not a second model.

A piece is what the lean forward keeps as one unit (weights.py): a decoder layer (fused, norm-folded,
FP8-quantised as at load) once every tensor the announced layout names for it has arrived; the embedding at
once; the lm_head once the final norm (and, untied, the head) arrived. The served piece is dropped just
before its replacement is built, so an update adds a bucket and one piece's temporaries to the served model.
The engine serves nothing meanwhile (Engine.update_weights_in_place), so no forward pass sees a mix; if the
update stops once the first piece was installed, the model is a mix: the engine marks it and serves nothing
until a whole update replaced every piece (its source went away between pieces), or stops (a piece failed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from primebuild.errors import UserError

from .linear import Linear
from .model_config import ModelConfig
from .weights import DictSource, LayerWeights, ModelWeights, Reader, load_layer

EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def _own(layer: LayerWeights, sent: dict[str, torch.Tensor]) -> None:
    """Copy what the layer would share with the sent tensors (those kept as sent: o_proj, down, ...): a
    view would keep the whole bucket alive, and a delta receiver changes its copy at the next update."""
    shared = {t.untyped_storage().data_ptr() for t in sent.values()}

    def own(t: torch.Tensor | None) -> torch.Tensor | None:
        return t.clone() if t is not None and t.untyped_storage().data_ptr() in shared else t

    for f in dataclasses.fields(layer):
        value = getattr(layer, f.name)
        if type(value) is Linear:  # an Fp8Linear holds its own dequantised copy
            weight, bias = own(value.weight), own(value.bias)
            if weight is not value.weight or bias is not value.bias:
                setattr(layer, f.name, Linear(weight, bias))
        elif isinstance(value, torch.Tensor):
            setattr(layer, f.name, own(value))


def _layer_index(name: str) -> int | None:
    if not name.startswith("model.layers."):
        return None
    return int(name.split(".")[2])


class WeightsInPlace:
    def __init__(self, weights: ModelWeights, config: ModelConfig, names: Sequence[str], dtype: torch.dtype,
                 device: torch.device, fp8: bool):
        self.weights, self.config, self.dtype, self.device, self.fp8 = weights, config, dtype, device, fp8
        self.missing: dict[int, set[str]] = {}  # layer -> names not yet arrived
        for name in names:
            if (i := _layer_index(name)) is not None:
                self.missing.setdefault(i, set()).add(name)
        layers = set(range(config.num_layers))
        if set(self.missing) != layers or EMBED not in names or NORM not in names:
            raise UserError(f"the broadcast's tensors are not the served architecture's ({config.num_layers} "
                            f"layers, {EMBED}, {NORM}): layers {sorted(self.missing)}",
                            hint="the trainer and the server must hold the same model")
        self.untied = not config.tie_word_embeddings and HEAD in names
        self.arrived: dict[int, dict[str, torch.Tensor]] = {}  # tensors of layers not yet complete
        self.head: dict[str, torch.Tensor] = {}  # the final norm (and the untied head) until the head is built
        self.embed_done = self.head_done = False
        self.installed = 0  # pieces installed: after one, a failure leaves a mix
        self.pieces = config.num_layers + 2  # the layers, the embedding and the lm_head

    def _reader(self, tensors: dict[str, torch.Tensor]) -> Reader:
        return Reader(DictSource(tensors, "broadcast weights"), self.dtype, self.device)

    def add(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """One bucket's tensors (HF names); what they complete is installed before this returns."""
        kept: list[tuple[dict[str, torch.Tensor], str]] = []
        for name, tensor in bucket:
            i = _layer_index(name)
            if i is not None and i in self.missing:
                self.arrived.setdefault(i, {})[name] = tensor
                kept.append((self.arrived[i], name))
                self.missing[i].discard(name)
                if not self.missing[i]:
                    self._install_layer(i)
            elif name == EMBED:
                self.weights.embed = None  # first, as for a layer
                self.installed += 1
                embed = self._reader({name: tensor}).get(name, (self.config.vocab_size, self.config.hidden_size))
                self.weights.embed = embed.clone() if embed.data_ptr() == tensor.data_ptr() else embed
                self.embed_done = True
            elif name == NORM or (name == HEAD and self.untied):
                self.head[name] = tensor
                kept.append((self.head, name))
            elif name != HEAD:  # a tied head is the embedding's: its own copy is not needed
                raise UserError(f"broadcast tensor {name!r} is not part of the served model")
            self._install_head_when_ready()
        # a piece cut between buckets keeps its first tensors as copies, so this bucket's buffer can go
        for tensors, name in kept:
            if name in tensors:
                tensors[name] = tensors[name].clone()

    def _install_layer(self, i: int) -> None:
        packed = self.weights.layers[i].qkv.packed is not None  # served with oneDNN-packed copies (weights.py)
        # The served layer goes first (the engine is parked, and a failure from here on stops it anyway):
        # the update then adds the bucket and this layer's temporaries, not a second layer.
        self.weights.layers[i] = None
        self.installed += 1
        sent = self.arrived.pop(i)
        layer = load_layer(self._reader(sent), self.config, i, self.fp8)
        _own(layer, sent)
        sent.clear()  # nothing of this layer is left to keep past its bucket
        del self.missing[i]
        if packed:
            for linear in layer.dense():
                linear.pack()
        self.weights.layers[i] = layer

    def _install_head_when_ready(self) -> None:
        if self.head_done or not self.embed_done or NORM not in self.head or (self.untied and HEAD not in self.head):
            return
        h = self.config.hidden_size
        read = self._reader(self.head)
        packed = self.weights.lm_head.packed is not None
        self.weights.lm_head = None
        head = read.get(HEAD, (self.config.vocab_size, h)) if self.untied else self.weights.embed
        self.weights.lm_head = Linear(head * read.norm_weight(NORM, h)[None, :])
        if packed:
            self.weights.lm_head.pack()
        self.head.clear()  # (the same dict `add` looks at for tensors to keep)
        self.head_done = True
        self.installed += 1

    def torn(self) -> bool:
        """A piece is missing (dropped, its replacement not built): a mix with a hole, not servable again
        by any update that does not rebuild it first. A failure between pieces never leaves one."""
        w = self.weights
        return w.embed is None or w.lm_head is None or any(layer is None for layer in w.layers)

    def finish(self) -> None:
        """Every piece arrived and was installed."""
        if self.missing or not (self.embed_done and self.head_done):
            raise UserError(f"the weight broadcast ended before layers {sorted(self.missing)} "
                            f"{'' if self.head_done else 'and the lm_head '}were complete")
