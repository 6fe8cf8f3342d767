"""The engine: a scheduler thread with continuous batching over the lean forward pass.

One thread owns the model, the KV cache and every running sequence, so the hot path takes no locks.
Each iteration of its loop:

1. applies a pending weight swap (between steps, so no forward ever mixes two weight sets),
2. admits waiting work into free cache slots and prefills it in one padded batch (a request with n > 1
   is prefilled once and its KV copied to the other n - 1 slots),
3. runs one decode step over every sequence that was already running,
4. samples, appends, finishes sequences (EOS, stop token or string, max tokens) and frees their slots.

Requests therefore join and leave the running batch between decode steps. Results flow back through a
per-request `sink` callback, called on the engine thread with immutable `SeqUpdate`s; the HTTP layer
hands them to its event loop.

Weight updates: the new weights are read into fresh tensors on the caller's thread while decoding goes
on, then swapped in by reference between two steps. In-flight sequences are then either resumed on the
new weights (default: their KV cache is recomputed by re-prefilling prompt + tokens so far, so every
later token is exactly what the new weights give) or, with `in_flight="finish"`, allowed to finish on
the old weights while new work waits. Every token records the version that produced it.

A dead engine says so: a failed step aborts its requests and the loop goes on, but MAX_FAILED_STEPS
failed steps in a row (a broken device or model, not one bad batch), or the loop itself ending on an
error, mark the engine dead (`dead` holds the cause): pending requests are aborted, new ones refused
(EngineDead), and the server's /health answers 503 and the server exits (server.py), so that the
supervisor restarts it instead of the run waiting on a live server with a dead engine.

Mixed weights are not a dead engine: an update in place (a bucketed broadcast, `update_weights_in_place`)
whose source went away after some pieces were installed, each piece whole (old or new), leaves a model that
is neither policy. With no staged copy to go back to (on purpose: the memory of a second model), the engine
keeps running but marks it (`mixed` holds the cause): the requests it held are answered with an error, new
ones refused (WeightsMixed: 503 "weights_mixed" on the API) and /health says so, until a whole update lands
(the restarted trainer's next send, always whole) and clears it. The process, its model memory and KV cache
stay: no restart, no model load.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError

from primebuild.contracts.completion import WEIGHTS_MIXED
from primebuild.errors import Problem, UserError
from primebuild.kernels.dtypes import DTYPES
from primebuild.kernels.routing import encode_routes, routes_dtype
from primebuild.runtime.weight_sync.filesystem import STABLE, verify

from .kv_cache import KVCache
from .lora import AdapterMerger, is_adapter_folder
from .model import Qwen3Forward, RotaryTable
from .model_config import ModelConfig
from .prefilled import Prefilled, export_slot, install_slot
from .sampling import SamplingParams, make_generator, sample, sample_greedy
from .sequences import ChoiceResult, Request, Sequence, SeqUpdate
from .weights import ModelWeights, load_weights
from .weights_in_place import WeightsInPlace

log = logging.getLogger(__name__)

DECODE_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_FAILED_STEPS = 3


class EngineDead(RuntimeError):
    """The engine's loop has ended on an error: nothing will be served any more."""


class WeightsMixed(RuntimeError):
    """The served weights are a mix of two policies (an update in place cut off half-way): nothing is
    served until a whole update lands."""


@dataclass
class _Swap:
    forward_weights: object  # the weights to swap in; None for an update in place (update_weights_in_place)
    version: int
    in_flight: str
    done: threading.Event
    # in place: the engine thread sets `parked` at its safe point and waits for `loaded`, while the
    # caller's thread installs the new weights; `broken` is set when that failed after changing some
    parked: threading.Event | None = None
    loaded: threading.Event | None = None
    changed: bool = False
    broken: str | None = None
    mixed: bool = False  # broken, but every piece whole (old or new): the engine keeps running, serving nothing


class EngineMetrics:
    """Counters read by /metrics (written only by the engine thread)."""

    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished = 0
        self.decode_steps = 0
        self.prefill_steps = 0
        self.preemptions = 0
        self.weight_updates = 0
        self.kv_exported = 0  # P/D prefill: prompts whose KV went to the sink
        self.kv_installed = 0  # P/D decode: prompts continued from a shipped KV cache
        self.kv_stale = 0  # P/D decode: shipped KV of another policy version, prefilled here instead
        self.decode_batch_counts = [0] * (len(DECODE_BATCH_BUCKETS) + 1)
        self.decode_batch_sum = 0

    def observe_decode_batch(self, size: int) -> None:
        self.decode_steps += 1
        self.decode_batch_sum += size
        self.decode_batch_counts[bisect.bisect_left(DECODE_BATCH_BUCKETS, size)] += 1


class Engine:
    def __init__(
        self,
        model_path: str | Path,
        *,
        max_num_seqs: int = 64,
        max_model_len: int = 2048,
        dtype: str = "float32",
        device: str | None = None,
        seed: int = 0,
        policy_version: int = 0,
        eos_token_ids: list[int] | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        max_prefill_tokens: int = 8192,
        fp8: bool = False,
        batch_invariant: bool = False,
    ):
        if dtype not in DTYPES:
            raise UserError(f"dtype {dtype!r} is not supported", hint=f"use one of {', '.join(DTYPES)}")
        if max_num_seqs < 1 or max_model_len < 2:
            raise UserError("max_num_seqs must be >= 1 and max_model_len >= 2")
        self.model_path = str(model_path)
        self.config = ModelConfig.from_folder(model_path)
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.max_num_seqs = max_num_seqs
        self.max_model_len = min(max_model_len, self.config.max_position_embeddings)
        self.max_prefill_tokens = max(max_prefill_tokens, self.max_model_len)
        self.eos_token_ids = set(eos_token_ids or [])
        self.detokenize = detokenize
        self.version = policy_version
        self.fp8 = fp8  # FP8 block-quantised matmul weights, at load and at every update (model.py)
        self._adapters: AdapterMerger | None = None  # LoRA: the base weights adapters merge into (lora.py)
        weights = load_weights(model_path, self.config, self.dtype, self.device, fp8=fp8)
        rope = RotaryTable(self.config, self.max_model_len, self.dtype, self.device)
        self.forward = Qwen3Forward(self.config, weights, rope, batch_invariant=batch_invariant)
        self.cache = KVCache(self.config, max_num_seqs, self.max_model_len, self.dtype, self.device)
        self.generator = make_generator(seed, self.device)
        self.metrics = EngineMetrics()
        self._slot_index = torch.arange(max_num_seqs, device=self.device)
        self._moe_layers = [i for i, sparse in enumerate(self.config.sparse_layers) if sparse]
        self._has_routes = bool(self._moe_layers)

        self.running: list[Sequence] = []  # index == cache slot
        self.waiting: collections.deque = collections.deque()  # Request (new) or Sequence (resume)
        self._incoming: list[Request] = []
        self._cv = threading.Condition()
        self._paused = False
        self._shutdown = False
        self._swap: _Swap | None = None
        self._update_lock = threading.Lock()
        self._ids = itertools.count()
        self._abort_pending = False  # set by Request.abort from any thread; read by the engine thread
        self.dead: str | None = None  # why the engine stopped serving, once it has
        self.mixed: str | None = None  # why the weights are a mix of two policies, while they are
        self._thread = threading.Thread(target=self._run, name="primebuild-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- public, thread-safe
    def submit(self, prompt_ids: list[int], params: SamplingParams, sink, *, prefilled: Prefilled | None = None,
               export: bool = False) -> Request:
        """Queue a prompt; `sink(list[SeqUpdate])` is called on the engine thread as tokens arrive.

        P/D: `prefilled` continues from a KV cache computed elsewhere (used only if its policy version
        is the one being served, else the prompt is prefilled here); `export` computes the prompt's KV
        and calls `sink(Prefilled)` once, sampling nothing."""
        if not prompt_ids:
            raise UserError("the prompt has no tokens")
        # an export samples nothing here: its prompt needs room for one token (the decode server checks the rest)
        if len(prompt_ids) + (1 if export else params.max_tokens) > self.max_model_len:
            raise UserError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        if params.n > self.max_num_seqs:
            raise UserError(f"n ({params.n}) exceeds max_num_seqs ({self.max_num_seqs})")
        if prefilled is not None and list(prefilled.prompt_ids) != list(prompt_ids):
            raise UserError("the shipped KV cache belongs to another prompt")
        request = Request(next(self._ids), list(prompt_ids), params, sink, self._note_abort, prefilled, export)
        with self._cv:
            if self.dead is not None:
                raise EngineDead(f"the engine is dead: {self.dead}")
            self._refuse_if_mixed()
            self._incoming.append(request)
            self._cv.notify()
        return request

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, timeout: float = 600
    ) -> list[list[ChoiceResult]]:
        """Blocking convenience for benchmarks and tests: all prompts, all n choices, in order."""
        results = [[ChoiceResult(i, list(p)) for i in range(params.n)] for p in prompts]
        remaining = [len(prompts) * params.n]
        done = threading.Event()

        def sink_for(choices):
            def sink(updates):
                for update in updates:
                    choices[update.index].apply(update)
                    if update.finish_reason is not None:
                        remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()

            return sink

        for prompt, choices in zip(prompts, results, strict=True):
            self.submit(prompt, params, sink_for(choices))
        if not done.wait(timeout):
            raise TimeoutError("generation did not finish in time")
        return results

    def prompt_logprobs(self, prompt_ids: list[int]) -> list[float]:
        """The log-prob of each prompt token after the first under the current weights (Qwen3Forward.score).
        It runs on the caller's thread beside the engine loop: it only reads the weights, and a swap
        replaces the weights object whole, so a score sees one version throughout."""
        self._refuse_if_mixed()
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        return self.forward.score(ids).tolist()

    def _note_abort(self) -> None:
        self._abort_pending = True

    def pause(self) -> None:
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify()

    @property
    def paused(self) -> bool:
        return self._paused

    def update_weights(
        self,
        path: str | Path | Mapping[str, torch.Tensor],
        version: int,
        in_flight: str = "resume",
        timeout: float = 600,
    ) -> None:
        """Swap in new weights between two steps (blocks until swapped): an HF step folder, a LoRA adapter
        folder (merged into the served base: lora.py), or a state dict in HF naming (a weight broadcast),
        whose every tensor shape is checked on load."""
        if in_flight not in ("resume", "finish"):
            raise UserError(f"in_flight must be 'resume' or 'finish', not {in_flight!r}")
        with self._update_lock:
            weights = self._read_update(path)
            swap = _Swap(weights, int(version), in_flight, threading.Event())
            with self._cv:
                self._swap = swap
                self._cv.notify()
            if not swap.done.wait(timeout):
                raise TimeoutError("the weight swap did not happen in time (paused with requests in flight?)")
            if self.dead is not None:
                raise EngineDead(f"the engine is dead: {self.dead}")

    def _read_update(self, path: str | Path | Mapping[str, torch.Tensor]) -> ModelWeights:
        """The new weights, read and checked beside the served ones (nothing served changes here). A folder
        that does not read as weights (a broken file, a bad config or adapter) is the caller's error."""
        try:
            if not isinstance(path, Mapping) and (Path(path) / STABLE).is_file():
                verify(path)  # a published step folder: its files must be what it lists
            if not isinstance(path, Mapping) and is_adapter_folder(path):
                if self._adapters is None:
                    self._adapters = AdapterMerger(self.model_path)
                path = self._adapters.merged(path)
            if not isinstance(path, Mapping):
                config = ModelConfig.from_folder(path)
                if config.shape_signature() != self.config.shape_signature():
                    raise UserError(
                        Problem(
                            "the new weights have a different architecture than the served model",
                            file=str(Path(path) / "config.json"),
                            hint="weight updates must keep every shape of the served model",
                        )
                    )
            return load_weights(path, self.config, self.dtype, self.device, fp8=self.fp8)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError, SafetensorError) as err:
            # what a folder that is no weights of this model raises from safetensors, json, the config and
            # adapter readers (a torch RuntimeError, e.g. out of memory, is the server's own failure)
            where = "the broadcast tensors" if isinstance(path, Mapping) else str(path)
            raise UserError(f"{where}: not loadable as this model's weights ({type(err).__name__}: "
                            f"{str(err)[:300]})", hint="give a step folder the trainer published, or a LoRA "
                            "adapter folder of this model") from err

    def _refuse_if_mixed(self) -> None:
        if self.mixed is not None:
            raise WeightsMixed(f"the served weights are a mix of two policies: {self.mixed}")

    def update_weights_in_place(self, names: list[str], pull: Callable[[Callable[[list], None]], int],
                                in_flight: str = "resume", timeout: float = 600,
                                resumable: tuple[type[BaseException], ...] = ()) -> int:
        """Swap in weights that arrive a bucket at a time (a bucketed broadcast) without a second copy of
        the model: once the engine stops at a safe point (as for any swap), `pull(add)` hands every bucket
        to `add`, which installs each piece of the model it completes (weights_in_place.py), and returns
        the version they are. The engine serves nothing meanwhile. Returns that version.

        If `pull` fails after some pieces were installed, the model is a mix of two versions. With an
        error of a `resumable` type (its source went away and a whole update will follow) and every piece
        whole, the engine marks the weights mixed and keeps running (see the module's docstring);
        otherwise it stops. Either way the error is raised."""
        if in_flight not in ("resume", "finish"):
            raise UserError(f"in_flight must be 'resume' or 'finish', not {in_flight!r}")
        with self._update_lock:
            installer = WeightsInPlace(self.forward.weights, self.config, names, self.dtype, self.device, self.fp8)
            swap = _Swap(None, self.version, in_flight, threading.Event(), threading.Event(), threading.Event())
            with self._cv:
                self._swap = swap
                self._cv.notify()
            if not swap.parked.wait(timeout):
                swap.loaded.set()  # nothing changed: if the engine gets there later it just goes on
                raise TimeoutError("the engine did not stop for the weight update in time "
                                   "(paused with requests in flight?)")
            try:
                swap.version = pull(installer.add)
                installer.finish()
            except BaseException as err:
                if installer.installed:
                    swap.broken = (f"an update in place stopped after {installer.installed} of {installer.pieces} "
                                   f"pieces were installed ({type(err).__name__}: {err})")
                    swap.mixed = isinstance(err, resumable) and not installer.torn()
                raise
            finally:
                swap.changed = installer.installed > 0
                swap.loaded.set()  # the engine thread goes on, with the new weights or the unchanged old ones
                swap.done.wait()
            if self.dead is not None:
                raise EngineDead(f"the engine is dead: {self.dead}")
            return swap.version

    def shutdown(self) -> None:
        with self._cv:
            self._shutdown = True
            self._cv.notify()
        self._thread.join(timeout=30)

    def stats(self) -> dict:
        running = list(self.running)
        cached = sum(len(s.tokens) - 1 for s in running)
        return {
            "running": len(running),
            "waiting": len(self.waiting) + len(self._incoming),
            "kv_usage": cached / (self.max_num_seqs * self.max_model_len),
            "kv_bytes": self.cache.nbytes(),
            "policy_version": self.version,
            "paused": self._paused,
        }

    # ---------------------------------------------------------------- engine thread
    def _swap_ready(self) -> bool:
        return self._swap is not None and (self._swap.in_flight == "resume" or not self.running)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as error:  # noqa: BLE001 (whatever ended the loop is the engine's cause of death)
            log.critical("the engine loop died", exc_info=True)
            self._die(f"{type(error).__name__}: {error}")

    def _die(self, cause: str) -> None:
        with self._cv:  # after this no submit() gets in, so every request is answered
            self.dead = cause
            self.waiting.extend(self._incoming)
            self._incoming.clear()
            if self._swap is not None:
                self._swap.done.set()  # its caller reads `dead`
        self._fail_all(f"engine died: {cause}")

    def _mix(self, cause: str) -> None:
        """The weights are a mix of two versions: answer every request held with an error, refuse new ones
        (submit), and keep running until a whole update lands. The version label stays the last whole one."""
        with self._cv:  # after this no submit() gets in
            self.mixed = cause
            self.waiting.extend(self._incoming)
            self._incoming.clear()
        log.warning("the served weights are a mix of two policies (%s): serving nothing until a whole update",
                    cause)
        self._fail_all(f"the served weights are a mix of two policies: {cause}", code=WEIGHTS_MIXED)

    def _loop(self) -> None:
        failed_steps = 0
        while True:
            with self._cv:
                while not self._shutdown:
                    self.waiting.extend(self._incoming)
                    self._incoming.clear()
                    if self._swap_ready() or (not self._paused and (self.waiting or self.running)):
                        break
                    self._cv.wait()
                if self._shutdown:
                    return
            if self._swap_ready():
                self._apply_swap()
            if self._paused:
                continue
            try:
                self._step()
                failed_steps = 0
            except Exception as error:  # one bad batch must not kill the server, a broken engine must
                failed_steps += 1
                if failed_steps >= MAX_FAILED_STEPS:
                    raise
                log.exception("engine step failed; aborting the affected requests")
                self._fail_all(f"internal engine error: {type(error).__name__}: {error}")

    def _apply_swap(self) -> None:
        swap = self._swap
        if swap.parked is not None:  # in place: the caller's thread changes the weights while this one waits
            swap.parked.set()
            swap.loaded.wait()
            if swap.broken and not swap.mixed:
                raise RuntimeError(swap.broken)  # a mix with a piece missing, or nothing to mend it: it stops
            if swap.broken:
                self._mix(swap.broken)
                self._swap = None
                swap.done.set()
                return
            if not swap.changed:  # failed before changing anything, or timed out: the old weights stay
                self._swap = None
                swap.done.set()
                return
        else:
            self.forward.weights = swap.forward_weights
        self.version = swap.version
        if self.mixed is not None:
            log.info("policy version %d is whole: serving again", self.version)
            self.mixed = None  # every piece was replaced: a whole policy again
        # Resume in-flight sequences on the new weights: re-prefill them (front of the queue, in order).
        preempted = list(self.running)
        self.running.clear()
        for seq in reversed(preempted):
            seq.slot = -1
            self.waiting.appendleft(seq)
        self.metrics.preemptions += len(preempted)
        self.metrics.weight_updates += 1
        self._swap = None
        swap.done.set()

    def _step(self) -> None:
        self._drop_aborted()
        already_running = len(self.running)
        admitted = self._admit()
        installs = [u for u in admitted if isinstance(u, Request) and self._installable(u)]
        if installs:
            self._install(installs)
        if len(installs) < len(admitted):
            self._prefill([u for u in admitted if not (isinstance(u, Request) and u.prefilled is not None)])
        if already_running:
            self._decode(self.running[:already_running])

    def _drop_aborted(self) -> None:
        if not self._abort_pending:  # nothing to scan for: the common case, every step
            return
        self._abort_pending = False
        if any(_request_of(u).aborted for u in self.waiting):
            self.waiting = collections.deque(u for u in self.waiting if not _request_of(u).aborted)
        gone = [s for s in self.running if s.request.aborted]
        for seq in sorted(gone, key=lambda s: s.slot, reverse=True):
            self._release(seq)

    def _admit(self) -> list:
        """Take waiting work in arrival order while slots and the prefill token budget allow."""
        if self._swap is not None:  # draining for an update that finishes in-flight work first
            return []
        admitted, free, padded_len = [], self.max_num_seqs - len(self.running), 0
        while self.waiting:
            unit = self.waiting[0]
            if _request_of(unit).aborted:
                self.waiting.popleft()
                continue
            needs = (1 if unit.export else unit.params.n) if isinstance(unit, Request) else 1
            length = len(unit.prompt_ids) if isinstance(unit, Request) else len(unit.tokens)
            new_padded = max(padded_len, length)
            if needs > free or (admitted and new_padded * (len(admitted) + 1) > self.max_prefill_tokens):
                break
            self.waiting.popleft()
            admitted.append(unit)
            free -= needs
            padded_len = new_padded
        return admitted

    def _installable(self, request: Request) -> bool:
        """A shipped KV cache is used only if the weights that computed it are the ones served now: the
        KV of an old policy is never continued by a new one (it is prefilled here instead, and counted)."""
        shipped = request.prefilled
        if shipped is None:
            return False
        if shipped.version != self.version:
            log.info("request %s: KV computed by policy %d, serving %d: prefilling it here", request.id,
                     shipped.version, self.version)
            self.metrics.kv_stale += 1
            request.prefilled = None
            return False
        return True

    def _install(self, requests: list[Request]) -> None:
        """Continue prompts prefilled elsewhere: their KV into a slot (copied to the other n - 1), then
        the first token sampled from the shipped logits exactly as `_prefill` samples it."""
        seqs, logits = [], []
        for request in requests:
            shipped, length = request.prefilled, len(request.prompt_ids)
            request.prefilled = None
            self.cache.ensure(length)
            group = []
            for i in range(request.params.n):
                generator = None if request.params.seed is None else make_generator(request.params.seed + i,
                                                                                     self.device)
                seq = Sequence(request, i, generator, self.eos_token_ids, self.max_model_len)
                self._place(seq)
                group.append(seq)
            first = group[0].slot
            install_slot(self.cache, first, shipped, self.device, self.dtype)
            for seq in group:
                if seq.slot != first:
                    self.cache.copy_slot(first, seq.slot, length)
            seqs += group
            logits += [shipped.logits.to(self.device)] * len(group)
            self.metrics.prompt_tokens += length
            self.metrics.kv_installed += 1
        self._emit(seqs, torch.stack(logits))

    def _place(self, seq: Sequence) -> None:
        seq.slot = len(self.running)
        self.running.append(seq)

    def _prefill(self, units: list) -> None:
        token_lists, first_slots, groups = [], [], []
        for unit in units:
            if isinstance(unit, Request):
                params = unit.params
                seqs = []
                for i in range(1 if unit.export else params.n):
                    generator = None if params.seed is None else make_generator(params.seed + i, self.device)
                    seq = Sequence(unit, i, generator, self.eos_token_ids, self.max_model_len)
                    self._place(seq)
                    seqs.append(seq)
                token_lists.append(unit.prompt_ids)
                self.metrics.prompt_tokens += len(unit.prompt_ids)
            else:
                seqs = [unit]
                self._place(unit)
                token_lists.append(unit.tokens)
            first_slots.append(seqs[0].slot)
            groups.append(seqs)
        lengths = [len(t) for t in token_lists]
        steps = max(lengths)
        self.cache.ensure(steps)
        tokens = torch.zeros(len(token_lists), steps, dtype=torch.long)
        for row, ids in enumerate(token_lists):
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        routed = [] if self._has_routes and any(g[0].params.return_routed_experts for g in groups) else None
        logits = self.forward.prefill(
            tokens.to(self.device),
            torch.tensor(lengths, device=self.device),
            torch.tensor(first_slots, device=self.device),
            self.cache,
            routed,
        )
        self.metrics.prefill_steps += 1
        if routed is not None:  # before the forks and exports below read the first slot's rows
            self.cache.write_routes(torch.tensor(first_slots, device=self.device), slice(0, steps), routed)
        rows, seqs, exported = [], [], []
        for row, (group, length) in enumerate(zip(groups, lengths, strict=True)):
            if group[0].request.export:
                self._export(group[0], logits[row], length)
                exported.append(group[0])
                continue
            for seq in group:
                if seq.slot != group[0].slot:
                    self.cache.copy_slot(group[0].slot, seq.slot, length)
                rows.append(row)
                seqs.append(seq)
        if seqs:
            self._emit(seqs, logits[torch.tensor(rows, device=logits.device)])
        # Exported prompts leave their slots only now: `_release` moves the last sequence into the freed
        # slot copying all but its newest position, which holds for sequences that have sampled a token.
        for seq in sorted(exported, key=lambda s: s.slot, reverse=True):
            self._release(seq)

    def _export(self, seq: Sequence, logits: torch.Tensor, length: int) -> None:
        """P/D prefill: hand the prompt's KV (copied out of its slot) and last logits to the request's sink."""
        request = seq.request
        shipped = export_slot(self.cache, seq.slot, length, logits, request.prompt_ids, self.version,
                              request.params.return_routed_experts)
        self.metrics.kv_exported += 1
        try:
            request.sink(shipped)
        except Exception:
            log.exception("export sink failed for request %s", request.id)

    def _decode(self, seqs: list[Sequence]) -> None:
        batch = len(seqs)
        # One host-to-tensor conversion (of a flat list: the fastest form) for both inputs.
        positions = [len(s.tokens) - 1 for s in seqs]
        inputs = torch.tensor([s.tokens[-1] for s in seqs] + positions, device=self.device)
        max_len = max(positions) + 1
        self.cache.ensure(max_len)
        routed = [] if self._has_routes and any(s.params.return_routed_experts for s in seqs) else None
        logits = self.forward.decode(inputs[:batch], inputs[batch:], self.cache, max_len, routed)
        self.metrics.observe_decode_batch(batch)
        if routed is not None:  # decode rows are slots 0..batch-1
            self.cache.write_routes(self._slot_index[:batch], inputs[batch:], routed)
        self._emit(seqs, logits)

    def _emit(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token for each sequence, record it, finish what is done, tell the sinks."""
        if all(s.plain_greedy for s in seqs):
            out = sample_greedy(logits)
        else:
            out = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], self.generator)
        by_request: dict[int, tuple[Request, list[SeqUpdate]]] = {}
        finished = []
        versions = (self.version,)
        tops = out.top or [None] * len(seqs)
        for seq, token, logprob, top in zip(seqs, out.tokens, out.logprobs, tops, strict=True):
            tokens = seq.tokens
            tokens.append(token)
            if token in seq.stop_ids:
                reason, stop_text = "stop", None
            elif seq.params.stop and self.detokenize is not None:
                reason, stop_text = self._stop_string(seq)
            else:
                reason = stop_text = None
            if reason is None and len(tokens) >= seq.length_limit:
                reason = "length"
            top = None if top is None else (tuple(top),)
            if reason is None:
                update = SeqUpdate(seq.index, (token,), (logprob,), versions, top)
            else:
                finished.append(seq)
                routed = self._routes_of(seq) if seq.params.return_routed_experts and self._has_routes else None
                update = SeqUpdate(seq.index, (token,), (logprob,), versions, top, reason, stop_text, routed)
            request = seq.request
            entry = by_request.get(request.id)
            if entry is None:
                by_request[request.id] = (request, [update])
            else:
                entry[1].append(update)
        self.metrics.generation_tokens += len(seqs)
        if finished:
            self.metrics.requests_finished += len(finished)
            for seq in sorted(finished, key=lambda s: s.slot, reverse=True):
                self._release(seq)
        for request, updates in by_request.values():
            self._deliver(request, updates)

    def _routes_of(self, seq: Sequence) -> str:
        """The experts of every position `seq` fed through the model, in vLLM's wire layout: one row per
        decoder layer (zeros for dense ones), encoded once when the sequence finishes."""
        fed = len(seq.tokens) - 1  # its last token was sampled, never fed
        moe = self.cache.routes[seq.slot, :fed].cpu().numpy()
        out = np.zeros((fed, self.config.num_layers, moe.shape[-1]), dtype=routes_dtype(self.config.num_experts))
        out[:, self._moe_layers] = moe
        return encode_routes(out)

    def _stop_string(self, seq: Sequence) -> tuple[str | None, str | None]:
        """("stop", the string) if the text generated so far newly contains a stop string."""
        stops = seq.params.stop
        text = self.detokenize(seq.tokens[seq.prompt_len :])
        longest = max(len(s) for s in stops)
        for stop in stops:
            if stop in text[max(0, seq.stop_scan_from - longest + 1) :]:
                return "stop", stop
        seq.stop_scan_from = len(text)
        return None, None

    def _release(self, seq: Sequence) -> None:
        """Free a sequence's slot; the last running sequence moves in so the batch stays packed."""
        slot, last = seq.slot, self.running[-1]
        if last is not seq:
            self.cache.copy_slot(last.slot, slot, len(last.tokens) - 1)
            last.slot = slot
            self.running[slot] = last
        self.running.pop()
        seq.slot = -1

    def _deliver(self, request: Request, updates: list[SeqUpdate]) -> None:
        try:
            request.sink(updates)
        except Exception:  # a broken consumer must not stop the engine
            log.exception("request sink failed; aborting request %s", request.id)
            request.abort()

    def _fail_all(self, message: str, code: str | None = None) -> None:
        units = list(self.running) + list(self.waiting)
        self.running.clear()
        self.waiting.clear()
        seen: dict[int, tuple[Request, list[SeqUpdate]]] = {}
        for unit in units:
            request = _request_of(unit)
            indices = range(1 if request.export else request.params.n) if isinstance(unit, Request) else [unit.index]
            for index in indices:
                update = SeqUpdate(index, (), (), (), finish_reason="abort", error=message, error_code=code)
                seen.setdefault(request.id, (request, []))[1].append(update)
        for request, updates in seen.values():
            self._deliver(request, updates)


def _request_of(unit: Request | Sequence) -> Request:
    return unit if isinstance(unit, Request) else unit.request
