"""Sampling parameters and one vectorised sampling step over a batch of logit rows.

Log-probs are taken from the same processed logits that the token was drawn from (temperature applied,
top-k/top-p masked, renormalised): that is the distribution the sample really came from, which is
what an importance ratio needs. Greedy rows (temperature 0) take the argmax of the raw logits and
report log-probs of the raw logits (temperature 1, no filtering). A positive temperature below
MIN_TEMPERATURE is raised to it (vLLM's rule, which the trainer's manifest check matches): logits / 1e-40
overflow float32 to inf and the log-softmax to NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from primebuild.contracts.inference import MIN_SAMPLING_TEMPERATURE as MIN_TEMPERATURE


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: disabled
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    top_logprobs: int = 0  # how many alternatives to report per token (0: none)
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE


def make_generator(seed: int, device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % (2**63))
    return generator


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None  # per row, (token, logprob) best first; None if none asked


@torch.inference_mode()
def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> SampleOutput:
    """Draw one token per row of `logits` [B, V] (float32) according to that row's parameters."""
    batch = logits.shape[0]
    device = logits.device
    if all(p.temperature == 0 and not p.top_logprobs for p in params):
        return sample_greedy(logits)
    temperatures = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    greedy = temperatures == 0
    all_greedy = bool(greedy.all())
    processed = logits / torch.where(greedy, torch.ones_like(temperatures), temperatures)[:, None]

    top_ks = [p.top_k if p.top_k > 0 and p.temperature > 0 else 0 for p in params]
    top_ps = [p.top_p if p.temperature > 0 else 1.0 for p in params]
    if any(top_ks) or any(p < 1.0 for p in top_ps):
        processed = _filter(processed, top_ks, top_ps)
    logprobs = torch.log_softmax(processed, dim=-1)

    if all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p and vectorises; rows with
        # their own seed draw their noise from their own generator so that batching does not change them.
        noise = torch.empty_like(logprobs).exponential_(generator=default_generator)
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # a zero draw would divide 0 by 0
        drawn = (logprobs.exp() / noise).argmax(dim=-1)
        tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)

    top = None
    wanted = max(p.top_logprobs for p in params)
    if wanted > 0:
        values, indices = logprobs.topk(min(wanted, logprobs.shape[-1]), dim=-1)
        values, indices = values.tolist(), indices.tolist()
        top = [
            list(
                zip(
                    indices[row][: params[row].top_logprobs],
                    values[row][: params[row].top_logprobs],
                    strict=True,
                )
            )
            for row in range(batch)
        ]
    return SampleOutput(tokens=tokens.tolist(), logprobs=chosen.tolist(), top=top)


@torch.inference_mode()
def sample_greedy(logits: torch.Tensor) -> SampleOutput:
    """Every row greedy, no alternatives asked: the common case in evaluation, in four calls."""
    tokens = logits.argmax(dim=-1, keepdim=True)
    chosen = torch.log_softmax(logits, dim=-1).gather(1, tokens)
    return SampleOutput(tokens=tokens.view(-1).tolist(), logprobs=chosen.view(-1).tolist(), top=None)


def _filter(processed: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and then its nucleus (top-p) with -inf."""
    device = processed.device
    vocab = processed.shape[-1]
    sorted_logits, order = processed.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_ks], device=device)[:, None]
    remove = ranks >= k
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    p = torch.tensor(top_ps, dtype=processed.dtype, device=device)[:, None]
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep a token if the mass strictly before it is below top_p (the best token always stays).
    before = probs.cumsum(dim=-1) - probs
    remove = remove | (before >= p)
    mask = torch.zeros_like(remove).scatter(1, order, remove)
    return processed.masked_fill(mask, float("-inf"))
