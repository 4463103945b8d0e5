"""GAE over a hand-made trajectory with a termination and a truncation."""

import pytest
import torch

from mmpo.core import gae


def test_gae_hand_trajectory_with_termination_and_truncation():
    # column 0: step t   r   V   V(s_t+1)  terminated  truncated
    #               0    1   2   3         0           0
    #               1    0   3   4         1           0    <- terminal: V(s_2)=4 must be ignored
    #               2    1   1   2         0           0
    #               3    2   2   5         0           1    <- truncated: bootstrap from 5
    #               4    1   1   2         0           0    <- rollout ends: bootstrap from 2
    # column 1: five steps of reward 1, all values 0, no episode end.
    rewards = torch.tensor([[1.0, 1], [0, 1], [1, 1], [2, 1], [1, 1]])
    values = torch.tensor([[2.0, 0], [3, 0], [1, 0], [2, 0], [1, 0]])
    next_values = torch.tensor([[3.0, 0], [4, 0], [2, 0], [5, 0], [2, 0]])
    terminated = torch.tensor([[0, 0], [1, 0], [0, 0], [0, 0], [0, 0]], dtype=torch.bool)
    truncated = torch.tensor([[0, 0], [0, 0], [0, 0], [1, 0], [0, 0]], dtype=torch.bool)
    adv, ret = gae(rewards, values, next_values, terminated, truncated, gamma=0.5, lam=0.5)
    # column 0, gamma = lam = 0.5 (gamma * lam = 0.25):
    #   d0 = 1 + 0.5*3 - 2 = 0.5 ; d1 = 0 + 0 - 3 = -3 ; d2 = 1 + 0.5*2 - 1 = 1
    #   d3 = 2 + 0.5*5 - 2 = 2.5 ; d4 = 1 + 0.5*2 - 1 = 1
    #   A4 = 1 ; A3 = 2.5 (cut: truncated) ; A2 = 1 + 0.25*2.5 = 1.625
    #   A1 = -3 (cut: terminated) ; A0 = 0.5 + 0.25*(-3) = -0.25
    # column 1: d = 1 everywhere; A4 = 1, A3 = 1.25, A2 = 1.3125, A1 = 1.328125, A0 = 1.33203125
    expected_adv = torch.tensor(
        [[-0.25, 1.33203125], [-3.0, 1.328125], [1.625, 1.3125], [2.5, 1.25], [1.0, 1.0]]
    )
    assert torch.allclose(adv, expected_adv)
    # returns = A + V
    assert torch.allclose(ret, expected_adv + values)
    assert ret[:, 0].tolist() == [1.75, 0.0, 2.625, 4.5, 2.0]


def test_gae_lambda_one_gamma_one_is_monte_carlo_return_minus_value():
    rewards = torch.tensor([[1.0], [2.0], [3.0]])
    values = torch.tensor([[0.5], [0.25], [0.0]])
    done = torch.tensor([[0], [0], [1]], dtype=torch.bool)
    next_values = torch.tensor([[0.25], [0.0], [123.0]])  # V(s_t+1); the terminal one is ignored
    adv, ret = gae(rewards, values, next_values, done, torch.zeros_like(done), gamma=1.0, lam=1.0)
    # returns-to-go 6, 5, 3
    assert ret.flatten().tolist() == [6.0, 5.0, 3.0]
    assert adv.flatten().tolist() == [5.5, 4.75, 3.0]


def test_gae_shape_errors():
    x = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="equal"):
        gae(x, x, x, x, torch.zeros(3, 3))
