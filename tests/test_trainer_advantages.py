import math

import numpy as np
import pytest

from primebuild.runtime.orchestrator.advantages import advantages_by_group, group_relative_advantages


def test_mean_baseline_by_hand():
    adv = group_relative_advantages([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    assert adv.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]


def test_std_normalised_by_hand():
    # rewards 1, 2, 3, 6: mean 3; sample std = sqrt((4 + 1 + 0 + 9) / 3) = sqrt(14/3)
    adv = group_relative_advantages(np.array([[1.0, 2.0, 3.0, 6.0]]), normalize_std=True, eps=0.0)
    s = math.sqrt(14 / 3)
    assert adv[0].tolist() == pytest.approx([-2 / s, -1 / s, 0.0, 3 / s], rel=1e-6)


def test_equal_rewards_give_zero_even_with_std():
    adv = group_relative_advantages([[2.0, 2.0, 2.0]], normalize_std=True)
    assert np.abs(adv).max() == 0.0


def test_uneven_groups():
    out = advantages_by_group([1.0, 0.0, 4.0, 2.0, 0.0], ["a", "a", "b", "b", "b"])
    assert out == pytest.approx([0.5, -0.5, 2.0, 0.0, -2.0])
