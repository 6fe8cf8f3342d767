"""Every loss against numbers worked out by hand (with math.exp on scalars, not the code under test)."""

import math

import pytest
import torch

from primebuild.errors import UserError
from primebuild.runtime.trainer.losses import LOSSES, resolve_loss

# Five tokens; the last one is outside the loss mask and must never count.
LP = [-1.0, -1.0, -2.0, -0.5, -0.1]  # trainer
ILP = [-1.2, -0.5, -1.0, -0.5, -3.0]  # inference
ADV = [1.0, -1.0, 1.0, -1.0, 5.0]
MASK = [True, True, True, True, False]
DELTA = [a - b for a, b in zip(LP, ILP, strict=True)]  # 0.2, -0.5, -1.0, 0.0, 2.9
RATIO = [math.exp(d) for d in DELTA]


def run(name, **params):
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    loss, metrics = resolve_loss(name, params)(
        lp, torch.tensor(ILP, dtype=torch.float64), torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK)
    )
    loss.backward()
    return loss.item(), lp.grad.tolist(), {k: v.item() for k, v in metrics.items()}


def expected_mismatch_kl_sum():
    return sum(math.exp(d) - d - 1 for d, m in zip(DELTA, MASK, strict=True) if m)


def check_common(metrics, masked):
    assert metrics["tokens"] == 4
    assert metrics["mismatch_kl"] == pytest.approx(expected_mismatch_kl_sum(), rel=1e-12)
    assert metrics["masked"] == masked
    assert metrics["ratio"] == pytest.approx(sum(r for r, m in zip(RATIO, MASK, strict=True) if m), rel=1e-12)


def test_registry_names():
    assert set(LOSSES) == {"dppo-kl", "aipo", "grpo", "cispo"}


def test_grpo_by_hand():
    # eps 0.2: token0 A>0 with r=1.221>1.2 -> clipped value -1.2*A, no gradient;
    # token1 A<0 with r=0.607<0.8 -> clipped value -0.8*A = 0.8, no gradient;
    # token2 A>0, r=0.368 < 0.8: min picks the unclipped r*A -> value -r, gradient -A*r;
    # token3 r=1 -> value 1, gradient -A*r = 1.
    loss, grad, metrics = run("grpo", clip_low=0.2, clip_high=0.2)
    assert loss == pytest.approx(-1.2 + 0.8 - RATIO[2] + 1.0, rel=1e-12)
    assert grad == pytest.approx([0.0, 0.0, -RATIO[2], 1.0, 0.0], abs=1e-12)
    check_common(metrics, masked=2)


def test_dppo_kl_by_hand():
    # mask_bound 0.05 in probability. p - q per token:
    #   t0: e^-1 - e^-1.2 = 0.0667 > 0.05 with A>0 -> masked;
    #   t1: e^-1 - e^-0.5 = -0.2387, A<0 and q - p > 0.05 -> masked;
    #   t2: e^-2 - e^-1 = -0.2325, A>0: moving back, kept; t3: gap 0, kept.
    p = [math.exp(x) for x in LP]
    q = [math.exp(x) for x in ILP]
    assert p[0] - q[0] > 0.05 and q[1] - p[1] > 0.05
    tau = 0.5
    loss, grad, metrics = run("dppo-kl", mask_bound=0.05, kl_tau=tau)
    pg = -RATIO[2] * 1.0 + -RATIO[3] * -1.0
    kl = tau * (0.2**2 + 0.5**2 + 1.0**2 + 0.0)
    assert loss == pytest.approx(pg + kl, rel=1e-12)
    # d/dlp: PG term -A*r on kept tokens, KL term 2*tau*delta on every trained token.
    assert grad == pytest.approx(
        [2 * tau * 0.2, 2 * tau * -0.5, -RATIO[2] + 2 * tau * -1.0, 1.0, 0.0], abs=1e-12
    )
    check_common(metrics, masked=2)


def test_aipo_by_hand():
    # is_cap 1.1: t0 weight truncated to 1.1; others keep r. Value -A*w, gradient -A*w.
    loss, grad, metrics = run("aipo", is_cap=1.1)
    w = [1.1, RATIO[1], RATIO[2], 1.0]
    assert loss == pytest.approx(-1.1 + w[1] - w[2] + 1.0, rel=1e-12)
    assert grad == pytest.approx([-1.1, w[1], -w[2], 1.0, 0.0], abs=1e-12)
    check_common(metrics, masked=1)


def test_cispo_by_hand():
    # weight clipped above at 1.1: t0 1.221 -> 1.1, t1 0.607, t2 0.368 and t3 1 stay (no lower clip).
    # The gradient keeps flowing on clipped tokens (unlike grpo): -A*w everywhere.
    loss, grad, metrics = run("cispo", clip_high=0.1)
    w = [1.1, RATIO[1], RATIO[2], 1.0]
    assert loss == pytest.approx(-1.1 + w[1] - w[2] + 1.0, rel=1e-12)
    assert grad == pytest.approx([-1.1, w[1], -w[2], 1.0, 0.0], abs=1e-12)
    check_common(metrics, masked=1)


def test_defaults_are_the_manifest_defaults():
    # one default per parameter: the manifest's loss classes are the trainer's (contracts/loss.py)
    from primebuild.contracts.loss import Grpo
    from primebuild.manifest.schema import Orchestrator

    assert Orchestrator(loss={"name": "grpo"}).loss == Grpo(name="grpo")
    assert resolve_loss("grpo").__name__ == "grpo_bound"


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_on_policy_all_losses_reduce_to_reinforce(name):
    # At Δ = 0 (and no KL pull) every loss has the REINFORCE gradient -A on each trained token.
    lp = torch.tensor([-0.3, -1.7, -0.9], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([0.5, -2.0, 1.5], dtype=torch.float64)
    mask = torch.tensor([True, True, False])
    loss, m = resolve_loss(name)(lp, lp.detach().clone(), adv, mask)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-0.5, 2.0, 0.0], abs=1e-12)
    assert loss.item() == pytest.approx(-0.5 + 2.0, abs=1e-12)
    assert m["mismatch_kl"].item() == 0.0 and m["masked"].item() == 0


def test_resolve_loss_rejects_unknown_name_and_param():
    with pytest.raises(UserError, match="unknown loss"):
        resolve_loss("ppo2")
    with pytest.raises(UserError, match="no parameter"):
        resolve_loss("grpo", {"is_cap": 2.0})
    with pytest.raises(UserError, match="greater than 0"):
        resolve_loss("aipo", {"is_cap": -1})
