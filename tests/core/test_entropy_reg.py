"""EPO's smoothing penalty and phase weight (arXiv 2509.22576; WujiangXu/EPO dp_actor.py), by hand."""

import math

import pytest
import torch

from mmpo.core.entropy_reg import epo_phase_weight, epo_smoothing_penalty

ENTROPY = torch.tensor([[0.2, 1.0, 2.0], [1.4, 0.6, 5.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_mode_band_hand_computed():
    # H_hist 1.0, band (0.5, 1.5): 0.2 out, 1.0 in, 2.0 out | 1.4 in, 0.6 in, (5.0 padding)
    penalty, within = epo_smoothing_penalty(ENTROPY, MASK, 1.0, min_ratio=0.5, max_ratio=1.5, penalty=0.1)
    assert penalty.tolist() == [[pytest.approx(0.1), 0.0, pytest.approx(0.1)], [0.0, 0.0, pytest.approx(0.1)]]
    assert float(within) == pytest.approx(3 / 5)  # 3 of the 5 masked-in tokens in the band
    # the bounds are excluded: H = 1.5 exactly is out
    edge, _ = epo_smoothing_penalty(torch.tensor([[1.5]]), torch.ones(1, 1), 1.0)
    assert edge.item() == pytest.approx(0.1)
    assert not penalty.requires_grad


def test_seq_mode_uses_masked_sequence_means():
    # row means over masked-in tokens: (0.2 + 1 + 2) / 3 = 1.0667, (1.4 + 0.6) / 2 = 1.0
    penalty, within = epo_smoothing_penalty(ENTROPY, MASK, 1.0, mode="seq")
    assert penalty.abs().sum() == 0 and float(within) == 1.0  # both in (0.5, 1.5)
    # H_hist 2.0, band (1.0, 3.0): row 0 in, row 1 (1.0, bound excluded) out -> P = 0.1 on its row
    penalty, within = epo_smoothing_penalty(ENTROPY, MASK, 2.0, mode="seq")
    assert penalty[0].tolist() == [0.0] * 3 and penalty[1].tolist() == [pytest.approx(0.1)] * 3
    assert float(within) == 0.5


def test_phase_weight_hand_computed():
    assert epo_phase_weight(0) == 1.0
    assert epo_phase_weight(75) == pytest.approx(1 - 0.2 * (1 - math.exp(-2)))  # 0.827067
    assert epo_phase_weight(100) == pytest.approx(0.8 * math.exp(-1))  # 0.8 exp(-3 * 25 / 75) = 0.294304
    assert epo_phase_weight(150) == pytest.approx(0.8 * math.exp(-3))  # 0.039830
    assert epo_phase_weight(400) == epo_phase_weight(150)  # clamped to E


def test_bad_settings():
    with pytest.raises(ValueError, match="unknown EPO mask mode"):
        epo_smoothing_penalty(ENTROPY, MASK, 1.0, mode="sequence")
    with pytest.raises(ValueError, match="min_ratio < max_ratio"):
        epo_smoothing_penalty(ENTROPY, MASK, 1.0, min_ratio=1.5, max_ratio=0.5)


def test_no_history_means_no_penalty_and_the_history_is_a_running_mean():
    from mmpo.core.entropy_reg import EntropyHistory

    penalty, within = epo_smoothing_penalty(ENTROPY, MASK, None, penalty=0.1)
    assert penalty.abs().sum() == 0 and float(within) == 1.0
    history = EntropyHistory()
    assert history.mean is None
    history.update(0.5)
    history.update(2.0)
    assert history.mean == pytest.approx(1.25) and history.state_dict() == {"total": 2.5, "count": 2}
