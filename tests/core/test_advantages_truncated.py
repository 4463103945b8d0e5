"""T-PPO extended GAE (mmpo.core.advantages_truncated): hand-worked values."""

from __future__ import annotations

import pytest
import torch

from mmpo.core import compute_advantages_with_metrics
from mmpo.core.advantages_truncated import truncated_gae

D = torch.float64
# row 0 completed after 3 tokens (reward 1); row 1 truncated after 2 tokens (bootstrap V = 0.7)
VALUES = torch.tensor([[0.2, 0.5, 0.8], [0.4, 0.1, 9.0]], dtype=D)  # 9.0 sits off the mask
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D)
REWARDS = torch.tensor([1.0, 5.0], dtype=D)  # row 1's reward is ignored (it has not ended)
COMPLETED = torch.tensor([True, False])
BOOT = torch.tensor([3.0, 0.7], dtype=D)  # row 0's bootstrap is ignored (it ended)


def test_gamma_lambda_one_is_return_minus_value():
    # row 0: deltas .5-.2=.3, .8-.5=.3, 1-.8=.2 -> A = [.8, .5, .2] (= 1 - V)
    # row 1: deltas .1-.4=-.3, .7-.1=.6 -> A = [.3, .6] (= 0.7 - V)
    adv, ret = truncated_gae(REWARDS, VALUES, MASK, COMPLETED, BOOT)
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.5, 0.2], [0.3, 0.6, 0.0]], dtype=D))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [0.7, 0.7, 0.0]], dtype=D))


def test_discounted_extended_gae():
    # gamma .9, lam .5 (gamma*lam = .45)
    # row 0: d0 = .9*.5-.2 = .25, d1 = .9*.8-.5 = .22, d2 = 1-.8 = .2; A2 = .2, A1 = .22+.45*.2 = .31,
    #        A0 = .25+.45*.31 = .3895
    # row 1: d0 = .9*.1-.4 = -.31, d1 = .9*.7-.1 = .53; A1 = .53, A0 = -.31+.45*.53 = -.0715
    adv, ret = truncated_gae(REWARDS, VALUES, MASK, COMPLETED, BOOT, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.3895, 0.31, 0.2], [-0.0715, 0.53, 0.0]], dtype=D))
    torch.testing.assert_close(ret, torch.tensor([[0.5895, 0.81, 1.0], [0.3285, 0.63, 0.0]], dtype=D))


def test_registered_estimator():
    adv, metrics = compute_advantages_with_metrics("tppo", REWARDS, torch.tensor([0, 0]), mask=MASK, values=VALUES,
                                                   completed=COMPLETED, bootstrap_values=BOOT)
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.5, 0.2], [0.3, 0.6, 0.0]], dtype=D))
    assert metrics["advantages/truncated_frac"] == 0.5
    with pytest.raises(ValueError, match="completed"):
        compute_advantages_with_metrics("tppo", REWARDS, torch.tensor([0, 0]), mask=MASK, values=VALUES,
                                        completed=COMPLETED[:1], bootstrap_values=BOOT)
