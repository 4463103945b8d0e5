"""Rollout IS correction: hand-worked weights and metrics, and the weight on the per-token loss."""

from __future__ import annotations

import math

import pytest
import torch

from mmpo.core import policy_loss, rollout_is_weights

# trainer - rollout per real token: row 0 (0.5, -1, 0), row 1 (0, 0.1, [pad])
TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.1, 0.0]])
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -0.2, 7.0]])  # the pad entry is junk: it must not count
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
E = math.exp


@pytest.mark.parametrize(
    ("mode", "cap", "expected", "clipped"),
    [
        ("token_truncate", 1.5, [[1.5, E(-1), 1.0], [1.0, E(0.1), 0.0]], 1 / 5),
        ("token_mask", 1.5, [[0.0, E(-1), 1.0], [1.0, E(0.1), 0.0]], 1 / 5),
        # sequence log-weights: row 0: 0.5 - 1 + 0 = -0.5, row 1: 0.1
        ("sequence_truncate", 1.5, [[E(-0.5)] * 3, [E(0.1), E(0.1), 0.0]], 0.0),
        ("sequence_truncate", 1.05, [[E(-0.5)] * 3, [1.05, 1.05, 0.0]], 1 / 2),
        ("sequence_mask", 1.05, [[E(-0.5)] * 3, [0.0, 0.0, 0.0]], 1 / 2),
    ],
)
def test_weights_and_clipped_fraction_by_hand(mode, cap, expected, clipped):
    weights, metrics = rollout_is_weights(TRAINER, ROLLOUT, MASK, mode, cap=cap)
    torch.testing.assert_close(weights, torch.tensor(expected), atol=1e-6, rtol=1e-6)
    assert float(metrics["rollout_is/clipped_frac"]) == pytest.approx(clipped)
    assert not weights.requires_grad


def test_mismatch_metrics_by_hand():
    _, metrics = rollout_is_weights(TRAINER, ROLLOUT, MASK, "token_truncate", cap=1.5)
    diffs = [0.5, -1.0, 0.0, 0.0, 0.1]
    assert float(metrics["rollout_is/kl"]) == pytest.approx(-sum(diffs) / 5)  # mean(log pi_rollout - log pi_trainer)
    assert float(metrics["rollout_is/k3_kl"]) == pytest.approx(sum(E(d) - 1 - d for d in diffs) / 5, rel=1e-6)
    assert float(metrics["rollout_is/logp_diff_mean"]) == pytest.approx(sum(abs(d) for d in diffs) / 5)
    assert float(metrics["rollout_is/logp_diff_max"]) == pytest.approx(1.0)
    assert float(metrics["rollout_is/mean"]) == pytest.approx((1.5 + E(-1) + 1 + 1 + E(0.1)) / 5, rel=1e-6)
    assert float(metrics["rollout_is/min"]) == pytest.approx(E(-1), rel=1e-6)
    assert float(metrics["rollout_is/max"]) == pytest.approx(1.5)


def test_sequence_metrics_count_sequences():
    _, metrics = rollout_is_weights(TRAINER, ROLLOUT, MASK, "sequence_truncate", cap=1.05)
    assert float(metrics["rollout_is/mean"]) == pytest.approx((E(-0.5) + 1.05) / 2, rel=1e-6)


def test_lower_bound_truncates_or_masks():
    truncated, _ = rollout_is_weights(TRAINER, ROLLOUT, MASK, "token_truncate", cap=1.5, cap_low=0.5)
    masked, metrics = rollout_is_weights(TRAINER, ROLLOUT, MASK, "token_mask", cap=1.5, cap_low=0.5)
    assert float(truncated[0, 1]) == pytest.approx(0.5) and float(masked[0, 1]) == 0.0
    assert float(metrics["rollout_is/clipped_frac"]) == pytest.approx(2 / 5)


def test_nan_engine_log_prob_gives_weight_one_and_huge_gap_stays_finite():
    rollout = ROLLOUT.clone()
    rollout[0, 2] = float("nan")
    rollout[1, 0] = -1000.0  # log-ratio 999.7: exp would overflow without the +-20 bound
    weights, metrics = rollout_is_weights(TRAINER, rollout, MASK, "sequence_mask", cap=2.0)
    assert float(weights[0, 2]) == pytest.approx(E(-0.5))  # the NaN token counts as ratio 1
    assert float(weights[1, 0]) == 0.0  # masked, not inf
    assert all(math.isfinite(float(v)) for k, v in metrics.items() if k != "rollout_is/kl")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"mode": "token"}, "unknown rollout_is mode"), ({"cap": 0.0}, "rollout_is_cap must be > 0"),
     ({"cap_low": 3.0}, "rollout_is_cap_low must be in")],
)
def test_bad_settings_raise(kwargs, message):
    args = {"mode": "token_truncate", "cap": 2.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        rollout_is_weights(TRAINER, ROLLOUT, MASK, args.pop("mode"), **args)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_token_weights_multiply_the_per_token_loss(agg):
    """ppo at ratio 1: loss_t = -A_i, so the weighted token-mean is -sum(w A m) / sum(m)."""
    log_probs = TRAINER.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -2.0])
    weights, _ = rollout_is_weights(TRAINER, ROLLOUT, MASK, "token_truncate", cap=1.5)
    loss, _ = policy_loss("ppo", log_probs, TRAINER, adv, MASK, agg=agg, token_weights=weights)
    per_token = -adv.unsqueeze(-1) * weights * MASK
    if agg == "token-mean":
        hand = per_token.sum() / MASK.sum()
    else:
        hand = (per_token.sum(-1) / MASK.sum(-1)).mean()
    assert float(loss.detach()) == pytest.approx(float(hand), rel=1e-6)
    loss.backward()  # gradient of -A w r: -A w per real token (r = 1), divided like the loss
    expected_grad = -adv.unsqueeze(-1) * weights * MASK
    divisor = MASK.sum() if agg == "token-mean" else MASK.sum(-1, keepdim=True) * 2  # 2 sequences
    expected_grad = expected_grad / divisor
    torch.testing.assert_close(log_probs.grad, expected_grad)


def test_token_weights_shape_is_checked():
    with pytest.raises(ValueError, match="token_weights shape"):
        policy_loss("ppo", TRAINER, TRAINER, torch.zeros(2), MASK, token_weights=torch.ones(2, 1))
