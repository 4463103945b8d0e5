"""Aggregation modes: hand values, original GRPO parity, micro-batch sums with global counts."""

import pytest
import torch

from mmpo.core import AGGREGATION_MODES, aggregate

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last row is pure padding


def test_hand_values():
    # real tokens: row 0 -> 1, 2 ; row 1 -> 4 ; row 2 -> none (skipped)
    assert aggregate(VALUES, MASK, "token-mean").item() == pytest.approx((1 + 2 + 4) / 3)
    assert aggregate(VALUES, MASK, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4.0) / 2)
    assert aggregate(VALUES, MASK, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    # Dr.GRPO: 7 / (2 sequences * L = 3 columns)
    assert aggregate(VALUES, MASK, "seq-mean-token-sum-norm").item() == pytest.approx(7 / 6)
    assert aggregate(VALUES, MASK, "seq-mean-token-sum-norm", norm_len=10).item() == pytest.approx(7 / 20)


def test_global_counts_replace_local_ones():
    assert aggregate(VALUES, MASK, "token-mean", global_tokens=14).item() == pytest.approx(7 / 14)
    assert aggregate(VALUES, MASK, "seq-mean-token-mean", global_seqs=5).item() == pytest.approx(5.5 / 5)
    assert aggregate(VALUES, MASK, "seq-mean-token-sum", global_seqs=torch.tensor(7)).item() == pytest.approx(1.0)
    assert aggregate(VALUES, MASK, "seq-mean-token-sum-norm", global_seqs=7, norm_len=2).item() == pytest.approx(0.5)


def test_seq_mean_token_mean_equals_original_grpo_normalisation():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    lengths = [7, 3, 1, 5, 6]
    mask = torch.zeros(5, 7)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    # GRPO (arXiv 2402.03300): (1/G) sum_i (1/|o_i|) sum_t l_it, written as loops
    reference = sum(sum(values[i, t].item() for t in range(n)) / n for i, n in enumerate(lengths)) / len(lengths)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx(reference, rel=1e-12)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_sum_of_microbatch_losses_equals_full_batch_loss(mode):
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(7, 6, generator=gen, dtype=torch.float64)
    mask = (torch.rand(7, 6, generator=gen) > 0.4).to(torch.float64)
    mask[3] = 0  # an all-padding row
    full = aggregate(values, mask, mode)
    global_tokens = mask.sum()
    global_seqs = (mask.sum(-1) > 0).sum()
    pieces = [slice(0, 2), slice(2, 3), slice(3, 7)]
    micro = [
        aggregate(values[s], mask[s], mode, global_tokens=global_tokens, global_seqs=global_seqs, norm_len=6)
        for s in pieces
    ]
    assert torch.stack(micro).sum().item() == pytest.approx(full.item(), rel=1e-12)
    # without global counts the micro-batch means do NOT add up to the full loss
    local = [aggregate(values[s], mask[s], mode) for s in pieces]
    assert torch.stack(local).sum().item() != pytest.approx(full.item(), rel=1e-6)


def test_errors():
    with pytest.raises(ValueError, match=r"unknown aggregation mode 'mean'.*token-mean"):
        aggregate(VALUES, MASK, "mean")
    with pytest.raises(ValueError, match="mask shape"):
        aggregate(VALUES, MASK[:2], "token-mean")
    with pytest.raises(ValueError, match="global_tokens must be positive"):
        aggregate(VALUES, MASK, "token-mean", global_tokens=0)
    with pytest.raises(ValueError, match=r"\(batch, time\)"):
        aggregate(VALUES[0], MASK[0], "token-mean")


def test_all_padding_batch_gives_zero_not_nan():
    for mode in AGGREGATION_MODES:
        assert aggregate(VALUES, torch.zeros_like(MASK), mode).item() == 0.0
