"""IGPO pieces: trigger, replacement rule, hint-entropy filter, loss on fixed tensors."""

from __future__ import annotations

import math

import pytest
import torch

from mmpo.dllm.igpo import all_wrong_groups, choose_replacements, hint_entropy_filter, igpo_loss


def test_all_wrong_groups_by_id_not_position():
    correct = torch.tensor([False, False, True, False, False, False])
    group_ids = torch.tensor([2, 0, 0, 2, 1, 1])  # shuffled positions
    assert all_wrong_groups(correct, group_ids).tolist() == [1, 2]


def test_replacement_overwrites_the_first_slots_with_at_most_k_correct_hinted_rollouts():
    hinted_correct = torch.tensor([False, True, True, False, True, True, True, False])  # 5 correct
    pairs = choose_replacements(hinted_correct, 4, torch.Generator().manual_seed(0))
    assert [slot for slot, _ in pairs] == [0, 1, 2, 3]  # the first k originals are replaced
    assert len({h for _, h in pairs}) == 4 and all(hinted_correct[h] for _, h in pairs)
    # Fewer correct than the cap: all of them, still into the first slots.
    two = torch.tensor([False, False, False, True, False, False, False, True])
    assert sorted(h for _, h in choose_replacements(two, 4)) == [3, 7]
    assert [s for s, _ in choose_replacements(two, 4)] == [0, 1]
    assert choose_replacements(torch.zeros(8, dtype=torch.bool), 4) == []  # nothing correct: no change
    # The choice among correct rollouts is random.
    picks = {tuple(sorted(h for _, h in choose_replacements(hinted_correct, 2, torch.Generator().manual_seed(s))))
             for s in range(20)}
    assert len(picks) > 1


def test_entropy_filter_keeps_top_20_percent_of_hint_tokens():
    hint = torch.zeros(3, 12, dtype=torch.bool)
    hint[0, :5] = True  # 5 hints -> keep max(1, floor(0.2 * 5)) = 1
    hint[1, :] = True  # 12 hints -> keep floor(2.4) = 2
    entropy = torch.tensor(
        [[0.1, 0.9, 0.3, 0.2, 0.5, 9, 9, 9, 9, 9, 9, 9],
         [0.5, 0.1, 0.7, 0.2, 0.3, 0.4, 0.6, 0.0, 0.05, 0.15, 0.25, 0.35],
         [0.0] * 12]
    )
    keep = hint_entropy_filter(hint, entropy, 0.2)
    assert torch.nonzero(keep[0, :5]).flatten().tolist() == [1]  # entropy 0.9 is the highest hint
    assert keep[0, 5:].all()  # generated tokens all count
    assert torch.nonzero(keep[1]).flatten().tolist() == [2, 6]  # entropies 0.7 and 0.6
    assert keep[2].all()  # a row without hints is untouched


def _fixed_tensors():
    # Row 0: A = +1, ratios [1.5, 0.9]; row 1: A = -1, ratios [0.5, 1.0].
    old = torch.log(torch.tensor([[0.2, 0.5], [0.4, 0.3]]))
    new = old + torch.log(torch.tensor([[1.5, 0.9], [0.5, 1.0]]))
    return new.clone().requires_grad_(True), old, torch.tensor([1.0, -1.0])


def test_token_level_loss_hand_computed():
    new, old, adv = _fixed_tensors()
    mask = torch.ones(2, 2)
    loss, metrics = igpo_loss(new, old, None, adv, mask, ratio_level="token", beta=0.0)
    # -min(1.5, 1.2) = -1.2; -min(0.9, 0.9) = -0.9; -min(-0.5, -0.8) = 0.8; -min(-1, -1) = 1.0
    assert loss.item() == pytest.approx((-1.2 - 0.9 + 0.8 + 1.0) / 4, abs=1e-6)
    assert metrics["policy/clipfrac"].item() == pytest.approx(2 / 4)
    # Dropping token (0, 1) from the loss mask: (-1.2 + 0.8 + 1.0) / 3.
    mask[0, 1] = 0
    loss, _ = igpo_loss(new, old, None, adv, mask, ratio_level="token", beta=0.0)
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 1.0) / 3, abs=1e-6)


def test_masked_sequence_loss_hand_computed_and_filtered_tokens_get_no_gradient():
    new, old, adv = _fixed_tensors()
    loss, _ = igpo_loss(new, old, None, adv, torch.ones(2, 2), ratio_level="sequence_masked", beta=0.0)
    s0 = math.sqrt(1.5 * 0.9)  # exp(mean(log 1.5, log 0.9)) = 1.162, inside [0.8, 1.2]
    s1 = math.sqrt(0.5)  # 0.707 < 0.8 with A < 0: clipped, loss 0.8
    assert s1 < 0.8
    assert loss.item() == pytest.approx((-s0 * 2 + 0.8 * 2) / 4, abs=1e-6)
    mask = torch.ones(2, 2)
    mask[0, 1] = 0  # a hint token dropped by the entropy filter
    loss, _ = igpo_loss(new, old, None, adv, mask, ratio_level="sequence_masked", beta=0.0)
    # Sequence ratio over the kept token only: s0 = 1.5 -> clipped to 1.2 for A > 0.
    assert loss.item() == pytest.approx((-1.2 + 0.8 * 2) / 3, abs=1e-6)
    loss.backward()
    assert new.grad[0, 1].item() == 0.0


def test_official_sequence_loss_hand_computed_and_filtered_tokens_still_get_gradient():
    new, old, adv = _fixed_tensors()
    s0 = math.sqrt(1.5 * 0.9)  # over all L = 2 positions, whatever the loss mask
    mask = torch.ones(2, 2)
    mask[0, 1] = 0  # a hint token dropped by the entropy filter: it carries no loss term ...
    loss, metrics = igpo_loss(new, old, None, adv, mask, ratio_level="sequence", beta=0.0)
    # ... so 3 terms: -s0 (row 0, kept token), and 0.8 twice (row 1 clipped: no gradient)
    assert loss.item() == pytest.approx((-s0 + 0.8 * 2) / 3, abs=1e-6)
    assert metrics["policy/clipfrac"].item() == pytest.approx(2 / 3)
    loss.backward()
    # ... but the gradient goes through s0 = exp(mean_t log-ratio) to both positions:
    # d(-s0 / 3) / d l_t = -s0 / 3 * 1/2 for t = 0 and t = 1
    assert new.grad[0].tolist() == pytest.approx([-s0 / 6, -s0 / 6], abs=1e-6)
    assert new.grad[1].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="ratio_level"):
        igpo_loss(new, old, None, adv, mask, ratio_level="seq", beta=0.0)


def test_k3_kl_term_is_added_with_beta():
    new, old, adv = _fixed_tensors()
    ref = new.detach().clone()
    ref[1, 1] += math.log(2.0)  # ref - new = log 2 -> k3 = 2 - log 2 - 1 = 0.3069
    with_kl, metrics = igpo_loss(new, old, ref, adv, torch.ones(2, 2), ratio_level="token", beta=0.01)
    without, _ = igpo_loss(new, old, None, adv, torch.ones(2, 2), ratio_level="token", beta=0.0)
    k3 = 2.0 - math.log(2.0) - 1.0
    assert metrics["losses/kl"].item() == pytest.approx(k3 / 4, abs=1e-6)
    assert (with_kl - without).item() == pytest.approx(0.01 * k3 / 4, abs=1e-7)
    with pytest.raises(ValueError, match="ratio_level"):
        igpo_loss(new, old, None, adv, torch.ones(2, 2), ratio_level="seq")


def test_a_loss_step_raises_the_log_prob_of_positive_advantage_tokens(toy_model):
    """Learning direction: one step on the estimator moves log-probs the way the advantages point."""
    from mmpo.dllm.logprobs import completion_log_probs

    prompt = torch.tensor([[5, 6], [5, 6]])
    attention = torch.ones_like(prompt)
    completions = torch.tensor([[3, 4, 2], [7, 8, 2]])
    adv = torch.tensor([0.5, -0.5])
    optimizer = torch.optim.SGD(toy_model.parameters(), lr=0.5)
    before, _ = completion_log_probs(toy_model, prompt, attention, completions, mask_token_id=1)
    before = before.detach()
    for _ in range(3):
        new, _ = completion_log_probs(toy_model, prompt, attention, completions, mask_token_id=1)
        loss, _ = igpo_loss(new, before, None, adv, torch.ones(2, 3), ratio_level="token", beta=0.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after, _ = completion_log_probs(toy_model, prompt, attention, completions, mask_token_id=1)
    assert after[0, :2].sum() > before[0, :2].sum()  # rewarded tokens more likely
    assert after[1, :2].sum() < before[1, :2].sum()  # penalised tokens less likely
