"""DPO-family and INPO losses on sequence log-probs: hand-computed values, gradients, errors."""

import math

import pytest
import torch

from mmpo.core import PREFERENCE_LOSSES, chosen_nll, inpo_loss, preference_loss

# pair 0: l_w = -1, l_l = -3, ref -2 / -2 -> chosen log-ratio 1, rejected -1, Delta = 2
# pair 1: l_w = -2, l_l = -1, ref -1.5 / -1.5 -> chosen -0.5, rejected 0.5, Delta = -1
CHOSEN = torch.tensor([-1.0, -2.0])
REJECTED = torch.tensor([-3.0, -1.0])
REF_CHOSEN = torch.tensor([-2.0, -1.5])
REF_REJECTED = torch.tensor([-2.0, -1.5])


def _softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_registry_names():
    assert PREFERENCE_LOSSES.names() == ["hinge", "ipo", "robust", "sigmoid"]


@pytest.mark.parametrize(
    "name, settings, expected",
    [
        # DPO, beta 0.5: beta Delta = 1 and -0.5 -> -log sigma(1) = log(1 + e^-1) = 0.3132617,
        # -log sigma(-0.5) = log(1 + e^0.5) = 0.9740770; mean 0.6436694
        ("sigmoid", {}, (_softplus(-1.0) + _softplus(0.5)) / 2),
        # cDPO eps 0.1: pair 0: 0.9 * 0.3132617 + 0.1 * log(1 + e) = 0.4132617;
        # pair 1: 0.9 * 0.9740770 + 0.1 * log(1 + e^-0.5) = 0.8766693 + 0.0474077 = 0.9240770
        ("sigmoid", {"label_smoothing": 0.1},
         (0.9 * _softplus(-1.0) + 0.1 * _softplus(1.0) + 0.9 * _softplus(0.5) + 0.1 * _softplus(-0.5)) / 2),
        # robust eps 0.1: pair 0: (0.9 * 0.3132617 - 0.1 * 1.3132617) / 0.8 = 0.1882617
        ("robust", {"label_smoothing": 0.1},
         ((0.9 * _softplus(-1.0) - 0.1 * _softplus(1.0)) / 0.8 + (0.9 * _softplus(0.5) - 0.1 * _softplus(-0.5)) / 0.8) / 2),
        # IPO beta 0.5: target 1 / (2 * 0.5) = 1 -> (2 - 1)^2 = 1, (-1 - 1)^2 = 4; mean 2.5
        ("ipo", {}, 2.5),
        # hinge: relu(1 - 1) = 0, relu(1 + 0.5) = 1.5; mean 0.75
        ("hinge", {}, 0.75),
    ],
)
def test_loss_hand_values(name, settings, expected):
    loss, metrics = preference_loss(name, CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5, **settings)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["losses/preference"] == pytest.approx(expected, rel=1e-6)
    # implicit rewards beta * log-ratio: chosen (0.5, -0.25) -> 0.125; rejected (-0.5, 0.25) -> -0.125
    assert metrics["rewards/chosen"] == pytest.approx(0.125)
    assert metrics["rewards/rejected"] == pytest.approx(-0.125)
    assert metrics["rewards/margins"] == pytest.approx(0.25)
    assert metrics["rewards/accuracies"] == 0.5  # pair 0 ranks chosen higher, pair 1 does not
    assert metrics["logps/chosen"] == pytest.approx(-1.5)
    assert metrics["logps/rejected"] == pytest.approx(-2.0)


def test_label_smoothing_zero_is_dpo_and_robust_matches_dpo():
    dpo, _ = preference_loss("sigmoid", CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5)
    robust, _ = preference_loss("robust", CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5)
    assert robust.item() == pytest.approx(dpo.item(), rel=1e-7)


def test_dpo_gradient():
    chosen = CHOSEN.clone().requires_grad_(True)
    rejected = REJECTED.clone().requires_grad_(True)
    loss, _ = preference_loss("sigmoid", chosen, rejected, REF_CHOSEN, REF_REJECTED, beta=0.5)
    loss.backward()
    # d/dl_w [-log sigma(beta Delta)] / 2 pairs = -beta sigma(-beta Delta) / 2:
    # pair 0: -0.5 * sigma(-1) / 2 = -0.0672353; pair 1: -0.5 * sigma(0.5) / 2 = -0.1556148
    sigma = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert chosen.grad.tolist() == pytest.approx([-0.25 * sigma(-1.0), -0.25 * sigma(0.5)], rel=1e-6)
    assert rejected.grad.tolist() == pytest.approx([0.25 * sigma(-1.0), 0.25 * sigma(0.5)], rel=1e-6)


def test_ipo_length_normalized():
    # pair 0 only: log-ratios 1 over 2 tokens and -1 over 4 tokens -> Delta = 0.5 + 0.25 = 0.75;
    # beta 0.5 target 1 -> (0.75 - 1)^2 = 0.0625
    loss, _ = preference_loss("ipo", CHOSEN[:1], REJECTED[:1], REF_CHOSEN[:1], REF_REJECTED[:1], beta=0.5,
                              length_normalize=True, chosen_lengths=torch.tensor([2]),
                              rejected_lengths=torch.tensor([4]))
    assert loss.item() == pytest.approx(0.0625)


def test_chosen_nll_is_a_token_mean_over_the_batch():
    # chosen log-probs -1 over 2 tokens and -2 over 4 tokens: NLL = (1 + 2) / (2 + 4) = 0.5
    # (not the mean of per-sequence means, (0.5 + 0.5) / 2, nor of sums, 1.5)
    assert chosen_nll(CHOSEN, torch.tensor([2, 4])).item() == pytest.approx(0.5)
    assert chosen_nll(torch.tensor([-3.0, -1.0]), torch.tensor([1, 3])).item() == pytest.approx(1.0)
    assert chosen_nll(torch.zeros(2), torch.zeros(2)).item() == 0.0  # no chosen token: 0, not NaN


def test_rpo_alpha_adds_the_chosen_nll_hand_value_and_gradient():
    # sigmoid DPO at beta 0.5 is 0.6436694 (test_loss_hand_values); chosen lengths 2 and 4 -> NLL 0.5
    # (test above); rpo_alpha 2: loss = 0.6436694 + 2 * 0.5 = 1.6436694
    dpo = (_softplus(-1.0) + _softplus(0.5)) / 2
    chosen = CHOSEN.clone().requires_grad_(True)
    lengths = torch.tensor([2, 4])
    loss, metrics = preference_loss("sigmoid", chosen, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5,
                                    chosen_lengths=lengths, rpo_alpha=2.0)
    assert loss.item() == pytest.approx(dpo + 1.0, rel=1e-6)
    assert metrics["losses/preference"] == pytest.approx(dpo, rel=1e-6)  # the parts, unweighted
    assert metrics["losses/sft"] == pytest.approx(0.5)
    loss.backward()
    # DPO's gradient (test_dpo_gradient) plus d/dl_w [2 * -(l_w0 + l_w1) / 6] = -1/3 for each pair
    sigma = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert chosen.grad.tolist() == pytest.approx([-0.25 * sigma(-1.0) - 1 / 3, -0.25 * sigma(0.5) - 1 / 3], rel=1e-6)
    # rpo_alpha 0 (the default): the NLL is logged, the loss is DPO's alone
    loss, metrics = preference_loss("sigmoid", CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5,
                                    chosen_lengths=lengths)
    assert loss.item() == pytest.approx(dpo, rel=1e-6) and metrics["losses/sft"] == pytest.approx(0.5)
    assert "losses/sft" not in preference_loss("sigmoid", CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED)[1]
    # IPO with RPO: 2.5 (test_loss_hand_values) + 0.5 * 0.5
    loss, _ = preference_loss("ipo", CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5, chosen_lengths=lengths,
                              rpo_alpha=0.5)
    assert loss.item() == pytest.approx(2.75)


def test_inpo_hand_value_and_gradient():
    # eta 0.5, tau 1 -> eta tau = 0.5; pair: l_w -1, l_l -3, ref -2 / -2, previous iterate -1.5 / -2.5
    # anchors: 0.5 * -2 + 0.5 * -1.5 = -1.75 and 0.5 * -2 + 0.5 * -2.5 = -2.25
    # rewards 0.75 and -0.75 -> h = 1.5; target eta / 2 = 0.25 -> loss 1.25^2 = 1.5625
    chosen = torch.tensor([-1.0], requires_grad=True)
    loss, metrics = inpo_loss(chosen, torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]),
                              torch.tensor([-1.5]), torch.tensor([-2.5]), eta=0.5, tau=1.0)
    assert loss.item() == pytest.approx(1.5625)
    assert metrics["rewards/chosen"] == pytest.approx(0.75)
    assert metrics["rewards/rejected"] == pytest.approx(-0.75)
    assert metrics["rewards/margins"] == pytest.approx(1.5)
    assert metrics["rewards/accuracies"] == 1.0
    loss.backward()
    assert chosen.grad.item() == pytest.approx(2 * 1.25)  # d/dl_w (h - 0.25)^2 = 2 (h - 0.25)


def test_inpo_with_full_reference_weight_is_online_ipo():
    # eta tau = 1: the previous iterate has weight 0 and the target eta / 2 = 1 / (2 beta) with beta = 1 / eta
    ipo, _ = preference_loss("ipo", CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=2.0)
    for prev in (torch.zeros(2), torch.tensor([5.0, -7.0])):
        inpo, _ = inpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, prev, prev.flip(0), eta=0.5, tau=2.0)
        assert inpo.item() == pytest.approx(ipo.item(), rel=1e-7)


def test_errors_name_the_valid_values():
    with pytest.raises(ValueError, match=r"unknown preference loss 'dpo'.*'sigmoid'"):
        preference_loss("dpo", CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\) for loss 'robust'"):
        preference_loss("robust", CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, label_smoothing=0.5)
    with pytest.raises(ValueError, match="applies to 'sigmoid' and 'robust' only"):
        preference_loss("ipo", CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, label_smoothing=0.1)
    with pytest.raises(ValueError, match="beta must be > 0"):
        preference_loss("sigmoid", CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.0)
    with pytest.raises(ValueError, match="one shape"):
        preference_loss("sigmoid", CHOSEN, REJECTED[:1], REF_CHOSEN, REF_REJECTED)
    with pytest.raises(ValueError, match="length_normalize needs"):
        preference_loss("ipo", CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, length_normalize=True)
    with pytest.raises(ValueError, match="rpo_alpha must be >= 0"):
        preference_loss("sigmoid", CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, rpo_alpha=-1.0)
    with pytest.raises(ValueError, match="rpo_alpha .* needs chosen_lengths"):
        preference_loss("sigmoid", CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, rpo_alpha=1.0)
    with pytest.raises(ValueError, match=r"eta \* tau <= 1"):
        inpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, CHOSEN, REJECTED, eta=1.0, tau=2.0)
