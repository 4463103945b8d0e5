"""CAMPO (MiroMind-M1, arXiv 2507.14683): the repetition critic with hand-computed loops, the penalty
in the module's rewards, the staged length budget with its checkpoint / resume, and the tiny config
through `mmpo fit`."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import BatchFeature

from mmpo.algos.campo import stage_at
from mmpo.core.repetition import loop_ratio, repetition_penalties
from mmpo.data.synthetic import make_items
from mmpo.training.config import LossConfig, RewardConfig, SamplingConfig, merged_settings


@pytest.mark.parametrize(("tokens", "min_repeats", "expected"), [
    # period 2 ([3, 4]) repeats 3 times at the end, from index 2: (8 - 2) / 8
    ([1, 2, 3, 4, 3, 4, 3, 4], 2, 0.75),
    ([5, 5, 5, 5], 2, 1.0),  # the whole sequence is the loop
    ([1, 2, 3], 2, 0.0),  # nothing repeats
    ([1, 2, 1, 2, 3], 2, 0.0),  # a repeat that is not at the end is no loop
    ([7, 1, 2, 1, 2], 2, 0.8),  # [1, 2] twice from index 1: 4 / 5
    ([7, 1, 2, 1, 2], 3, 0.0),  # two copies are not enough for min_repeats 3
    # period 1 gives start 1; period 2 ([1, 1] twice) also starts at 1: 4 / 5
    ([9, 1, 1, 1, 1], 2, 0.8),
    # period 1 ([6, 6]) starts at 4, then the longer period 3 ([4, 6, 6] twice) decides: start 0 -> 1.0
    ([4, 6, 6, 4, 6, 6], 2, 1.0),
])
def test_loop_ratio_hand_computed(tokens, min_repeats, expected):
    assert loop_ratio(tokens, min_repeats=min_repeats) == pytest.approx(expected)
    assert loop_ratio(torch.tensor(tokens), min_repeats=min_repeats) == pytest.approx(expected)


def test_repetition_penalties_only_on_budget_exhausting_loops():
    ids = torch.tensor([[1, 2, 3, 4, 3, 4, 3, 4],   # full budget, loop 0.75 -> penalised
                        [5, 5, 5, 5, 0, 0, 0, 0],   # a loop but it stopped at 4 of 8 tokens -> not checked
                        [1, 2, 3, 4, 5, 6, 7, 8],   # full budget, no loop
                        [7, 1, 2, 1, 2, 1, 2, 9]])  # full budget, the loop was broken by the last token
    mask = torch.tensor([[1] * 8, [1] * 4 + [0] * 4, [1] * 8, [1] * 8])
    penalties, ratios = repetition_penalties(ids, mask, max_length=8)
    assert ratios.tolist() == pytest.approx([0.75, 0.0, 0.0, 0.0])
    assert penalties.tolist() == pytest.approx([0.1, 0.0, 0.0, 0.0])  # official: a flat 0.1
    # ratio mode: 0.2 x 0.75 = 0.15; with only_truncated off the short loop counts too: 0.2 x 1.0
    penalties, ratios = repetition_penalties(ids, mask, max_length=8, penalty=0.2, mode="ratio", only_truncated=False)
    assert penalties.tolist() == pytest.approx([0.15, 0.2, 0.0, 0.0]) and ratios[1] == 1.0
    with pytest.raises(ValueError, match="repetition mode"):
        repetition_penalties(ids, mask, max_length=8, mode="adaptive")


def test_stage_at():
    # stages begin at steps 0, 10, 25
    assert [stage_at(s, [10, 25]) for s in (0, 9, 10, 24, 25, 100)] == [0, 0, 1, 1, 2, 2]
    assert stage_at(5, []) == 0


def _module(path, **settings):
    from mmpo.algos.campo import CAMPOModule

    return CAMPOModule(str(path), **merged_settings(dict(
        sampling=SamplingConfig(num_generations=2, max_new_tokens=8), loss=LossConfig(beta=0.0),
        rewards=RewardConfig(timeout_s=None)), settings))


def test_module_rewards_subtract_the_penalty(variant_tiny_vlm, scripted_reward):
    from mmpo.vlm.rollout import Rollout

    module = _module(variant_tiny_vlm, rewards={"weights": scripted_reward([1.0, 0.5])}, stage_lengths=[8, 16],
                     stage_starts=[5])
    ids = torch.tensor([[1, 2, 3, 4, 3, 4, 3, 4], [5, 5, 5, 5, 0, 0, 0, 0]])
    mask = torch.tensor([[1] * 8, [1] * 4 + [0] * 4])
    rows = make_items("count_shapes", 1, seed=0) * 2
    rollout = Rollout(rows=rows, group_ids=torch.tensor([0, 0]), prompt_inputs=BatchFeature({}), completion_ids=ids,
                      completion_mask=mask, texts=["a", "b"])
    rewards, metrics = module.compute_rewards(rollout)
    assert rewards.tolist() == pytest.approx([1.0 - 0.1, 0.5])  # only the budget-exhausting loop pays
    assert metrics["campo/repetition_frac"] == 0.5 and metrics["campo/loop_ratio_mean"] == pytest.approx(0.375)
    module.progress.stage = 1  # stage 2's budget is 16: the first response no longer exhausted it
    assert module.compute_rewards(rollout)[0].tolist() == pytest.approx([1.0, 0.5])


def test_settings_are_checked(variant_tiny_vlm):
    with pytest.raises(ValueError, match="one step per stage"):
        _module(variant_tiny_vlm, stage_lengths=[8, 16])
    with pytest.raises(ValueError, match="ascending"):
        _module(variant_tiny_vlm, stage_lengths=[8, 16, 32], stage_starts=[5, 5])
    with pytest.raises(ValueError, match="repetition_mode"):
        _module(variant_tiny_vlm, repetition_mode="dynamic")


def test_stage_schedule_and_resume(variant_tiny_vlm, tmp_path, scripted_reward, cpu_trainer):
    weights = scripted_reward([1.0, 0.0])
    loader = DataLoader(make_items("count_shapes", 2, seed=0), batch_size=2, collate_fn=lambda x: x)
    module = _module(variant_tiny_vlm, rewards={"weights": weights}, stage_lengths=[2, 5], stage_starts=[1])
    widths = []
    build = module.build_rollout
    module.build_rollout = lambda rows: widths.append(module.stage_max_new_tokens) or build(rows)
    trainer = cpu_trainer(2)
    trainer.fit(module, loader)
    assert widths == [2, 5]  # step 0 in stage 0 (2 tokens), step 1 in stage 1 (5 tokens)
    assert (module.progress.stage, module.progress.started_at) == (1, 1)
    trainer.save_checkpoint(tmp_path / "campo.ckpt")
    assert torch.load(tmp_path / "campo.ckpt", weights_only=False)["campo_stage"] == {
        "stage": 1, "started_at": 1, "lengths": [2, 5]}

    resumed = _module(variant_tiny_vlm, rewards={"weights": weights}, stage_lengths=[2, 5], stage_starts=[1])
    cpu_trainer(3).fit(resumed, loader, ckpt_path=tmp_path / "campo.ckpt")
    # restored: without the checkpoint's stage, step 2 would have "entered" stage 1 at step 2
    assert (resumed.progress.stage, resumed.progress.started_at) == (1, 1)
    other = _module(variant_tiny_vlm, rewards={"weights": weights}, stage_lengths=[2, 6], stage_starts=[1])
    with pytest.raises(ValueError, match="same schedule"):
        cpu_trainer(3).fit(other, loader, ckpt_path=tmp_path / "campo.ckpt")


def test_tiny_config_trains_two_steps(fit_variant):
    logged = fit_variant("campo", "--model.init_args.sampling.num_generations=2",
                         "--model.init_args.stage_lengths=[4,6]",
                         "--model.init_args.stage_starts=[1]")
    steps = [row for row in logged if row.get("campo/stage")]
    assert [float(r["campo/stage"]) for r in steps] == [0.0, 1.0]
    assert [float(r["campo/max_new_tokens"]) for r in steps] == [4.0, 6.0]
