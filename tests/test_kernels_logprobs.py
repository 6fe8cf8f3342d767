"""Chunked log-probs: the same values and gradients as full logits, for any chunk size."""

from __future__ import annotations

import inspect

import pytest
import torch

from primebuild.contracts.environments import BUILTIN_ARGS, BUILTIN_VERSIONS
from primebuild.kernels.logprobs import chunked_token_logprobs


def naive(hidden, weight, targets, temperature):
    logits = (hidden @ weight.T) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


@pytest.mark.parametrize("chunk", [1, 7, 50, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradients_match_full_logits(chunk, temperature):
    g = torch.Generator().manual_seed(0)
    n, h, v = 50, 16, 97
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    upstream = torch.randn(n, generator=g, dtype=torch.float64)

    lp, entropy = chunked_token_logprobs(hidden, weight, targets, temperature, chunk)
    (lp.double() * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want_lp, want_entropy = naive(hidden, weight, targets, temperature)
    (want_lp.double() * upstream).sum().backward()

    torch.testing.assert_close(lp, want_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-9, atol=1e-12)
    assert not entropy.requires_grad


def test_gradcheck():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (9,), generator=g)
    assert torch.autograd.gradcheck(lambda h, w: chunked_token_logprobs(h, w, targets, 0.8, 4)[0].double(),
                                    (hidden, weight))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="want hidden"):
        chunked_token_logprobs(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long), 1.0, 2)
    with pytest.raises(ValueError, match="chunk"):
        chunked_token_logprobs(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long), 1.0, 0)


def test_the_lock_s_environment_table_matches_the_built_in_environments():
    from primebuild.runtime.envs.registry import BUILTIN

    assert {env_id: str(cls.version) for env_id, cls in BUILTIN.items()} == BUILTIN_VERSIONS
    # and the plan's table of their args (builders/environments.py refuses others before a run starts)
    assert {env_id: tuple(inspect.signature(cls).parameters) for env_id, cls in BUILTIN.items()} == BUILTIN_ARGS


def test_bf16_hidden_states_give_fp32_log_probs_close_to_full_logits():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(33, 16, generator=g).bfloat16()
    weight = torch.randn(50, 16, generator=g)
    targets = torch.randint(0, 50, (33,), generator=g)
    lp, entropy = chunked_token_logprobs(hidden, weight, targets, 1.0, 8)
    assert lp.dtype == entropy.dtype == torch.float32
    want, _ = naive(hidden.float(), weight.bfloat16().float(), targets, 1.0)
    torch.testing.assert_close(lp, want, rtol=2e-2, atol=2e-2)  # the matmul itself ran in bf16
