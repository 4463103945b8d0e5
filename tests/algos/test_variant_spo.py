"""SPO (Single-stream PO, arXiv 2509.13232): the tracker's formulas with hand-computed values (the
worked values of docs/algorithm_sources.md section 10 among them), the drift-based forgetting on a
real model, the tracker's checkpoint round trip and resume, and the tiny config through `mmpo fit`."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from torch.utils.data import DataLoader

from mmpo.algos.spo_tracker import (
    BetaTracker,
    kl_forgetting_rho,
    offline_prior,
    priority_weights,
    sample_prompts,
    spo_advantages,
)
from mmpo.data.synthetic import make_items
from mmpo.training.config import LossConfig, RewardConfig, SamplingConfig, merged_settings


def test_kl_forgetting_rho_worked_values():
    """rho = 2^(-D / 0.06) clipped to [0.875, 0.96]: ``verl-recipe:spo/spo_ray_trainer.py``,
    ``spo/config/spo_trainer.yaml`` (docs/algorithm_sources.md section 10)."""
    rho = kl_forgetting_rho(torch.tensor([0.06, 0.01, 0.0]))
    # 2^(-0.06/0.06) = 0.5 -> clipped up to 0.875; 2^(-1/6) = 0.890899 (inside); 2^0 = 1 -> clipped to 0.96
    assert rho.tolist() == pytest.approx([0.875, 0.890899, 0.96], abs=1e-6)
    # other bounds: 2^(-0.03/0.06) = 0.707107, now inside [0.5, 1]
    assert float(kl_forgetting_rho(torch.tensor(0.03), rho_min=0.5, rho_max=1.0)) == pytest.approx(0.707107, abs=1e-6)


def test_offline_prior_worked_values():
    """N_init (s + 0.5) / (N_eff + 1) prior: ``verl-recipe:spo/spo_ray_trainer.py``, ``offline_N`` 8
    (docs/algorithm_sources.md section 10)."""
    alpha, beta = offline_prior([1, 1, 0, 1, 1, 0, 1, 1])  # 6 of 8 successes
    # N_init = 1 / (1 - 0.875) = 8; alpha0 = 8 (6 + 0.5) / 9 = 5.777778; beta0 = 8 (2 + 0.5) / 9 = 2.222222
    assert (alpha, beta) == pytest.approx((52 / 9, 20 / 9))
    assert alpha == pytest.approx(5.778, abs=5e-4) and beta == pytest.approx(2.222, abs=5e-4)
    assert alpha / (alpha + beta) == pytest.approx(0.7222, abs=5e-5)  # p_hat = 6.5 / 9
    assert offline_prior([1, 0], offline_n=0) == (0.5, 0.5)
    # scores are binarised > 0: 0.3 and 2.0 count, 0 and -1 do not -> s = 2; still / (N + 1) = 9
    assert offline_prior([0.3, 0.0, -1.0, 2.0]) == pytest.approx((8 * 2.5 / 9, 8 * 6.5 / 9))
    # more than offline_n scores are subsampled to offline_n (all successes here: s = 2 of N = 2)
    assert offline_prior([1.0] * 5, offline_n=2, rng=random.Random(1)) == pytest.approx((8 * 2.5 / 3, 8 * 0.5 / 3))


def test_batch_normalised_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    p_hat = torch.tensor([0.5, 0.5, 0.75, 0.25], dtype=torch.float64)
    # A = r - p_hat = [0.5, -0.5, 0.25, -0.25]; mean 0; unbiased std = sqrt(0.625 / 3) = 0.456435
    std = math.sqrt(0.625 / 3)
    expected = [a / (std + 1e-8) for a in (0.5, -0.5, 0.25, -0.25)]  # +-1.095445, +-0.547723
    assert spo_advantages(rewards, p_hat).tolist() == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match=">= 2 responses"):
        spo_advantages(rewards[:1], p_hat[:1])
    # under DDP the statistics come from every rank's raw advantages: here a second rank's [0.5, -0.5]
    # -> batch [0.5, -0.5, 0.25, -0.25, 0.5, -0.5]: mean 0, std sqrt(1.125 / 5) = 0.474342
    others = torch.tensor([0.5, -0.5], dtype=torch.float64)
    local = spo_advantages(rewards, p_hat, batch=torch.cat([rewards - p_hat, others]))
    assert local.tolist() == pytest.approx([a / (math.sqrt(1.125 / 5) + 1e-8) for a in (0.5, -0.5, 0.25, -0.25)])


def test_priority_weights_and_sampling():
    w = priority_weights(torch.tensor([0.5, 6.5 / 9, 0.0]))
    # sqrt(0.25) + 0.05 = 0.55; sqrt(6.5/9 * 2.5/9) + 0.05 = sqrt(16.25)/9 + 0.05 = 0.497906; 0 + 0.05
    assert w.tolist() == pytest.approx([0.55, math.sqrt(16.25) / 9 + 0.05, 0.05], abs=1e-6)
    g = torch.Generator().manual_seed(0)
    assert sample_prompts(torch.tensor([0.0, 0.0, 1.0]), 1, g).tolist() == [2]  # only the weighted one
    picks = sample_prompts(torch.tensor([1.0, 1.0, 1.0]), 3, g).tolist()
    assert sorted(picks) == [0, 1, 2]  # k <= M: without replacement
    assert sample_prompts(torch.tensor([0.0, 1.0]), 4, g).tolist() == [1, 1, 1, 1]  # k > M: with replacement


def test_tracker_update_and_state_round_trip():
    tracker = BetaTracker(offline_values={"a": [1, 1, 0, 1, 1, 0, 1, 1]})
    assert tracker.p_hat(["a", "b"]).tolist() == pytest.approx([6.5 / 9, 0.5])
    assert len(tracker) == 1  # reading "b" did not add it
    tracker.update(["a", "b", "b"], torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0.875, 0.96, 0.9]))
    # a: 0.875 * 52/9 + 0 = 5.055556, 0.875 * 20/9 + 1 = 2.944444
    assert (tracker.alpha["a"], tracker.beta["a"]) == pytest.approx((0.875 * 52 / 9, 0.875 * 20 / 9 + 1))
    # b drawn twice: both from (0.5, 0.5), the last position wins: 0.9 * 0.5 + 0 = 0.45, 0.9 * 0.5 + 1 = 1.45
    assert (tracker.alpha["b"], tracker.beta["b"]) == pytest.approx((0.45, 1.45))
    assert tracker.visits == {"a": 1, "b": 2}
    tracker.responses["a"] = ([5, 6], [-0.1, -0.2])
    copy = BetaTracker()
    copy.load_state_dict(json.loads(json.dumps(tracker.state_dict())))  # plain data: survives any serialiser
    assert copy.state_dict() == tracker.state_dict()
    with pytest.raises(ValueError, match="lacks"):
        copy.load_state_dict({"alpha": {}})


# ---------------------------------------------------------------------- the module on a tiny model


def _module(path, **settings):
    from mmpo.algos.spo import SPOModule

    return SPOModule(str(path), **merged_settings(dict(
        sampling={"max_new_tokens": 4}, loss=LossConfig(beta=0.0), rewards=RewardConfig(timeout_s=None)), settings))


def test_settings_are_checked(variant_tiny_vlm):
    with pytest.raises(ValueError, match="single-stream"):
        _module(variant_tiny_vlm, sampling={"num_generations": 2})
    with pytest.raises(ValueError, match="rho_type"):
        _module(variant_tiny_vlm, rho_type="linear")


def test_drift_forgetting_on_the_stored_response(variant_tiny_vlm):
    module = _module(variant_tiny_vlm)
    rows = make_items("count_shapes", 3, seed=0)
    torch.manual_seed(0)
    rollout = module.engine.generate(rows, num_samples=1, max_new_tokens=4)
    rewards = torch.tensor([1.0, 0.0, 1.0])
    module.compute_advantages(rewards, rollout.group_ids, rollout)
    metrics = module.update_tracker(rollout, rewards)
    # first visits: D = 0, rho = 2^0 = 1 -> clipped to 0.96; alpha = 0.96 * 0.5 + r
    assert metrics["spo/first_visit_frac"] == 1.0 and metrics["spo/rho_mean"] == pytest.approx(0.96)
    ids = [str(r["id"]) for r in rows]
    assert [module.tracker.alpha[i] for i in ids] == pytest.approx([1.48, 0.48, 1.48])
    before = module.sequence_log_probs(module.model, rollout)[0].detach().double()
    with torch.no_grad():  # move the policy: the stored responses' log-probs drift
        for p in module.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    after = module.sequence_log_probs(module.model, rollout)[0].detach().double()
    mask = rollout.completion_mask.double()
    expected = ((before - after).abs() * mask).sum(-1) / mask.sum(-1)
    assert float(expected.min()) > 0
    drift, responses = module.response_drift(rollout, ids)  # the same prompts again, same stored responses
    torch.testing.assert_close(drift, expected, rtol=1e-5, atol=1e-7)
    lengths = rollout.completion_mask.sum(-1).tolist()  # the new responses to store, with today's log-probs
    assert [len(responses[i][0]) for i in ids] == lengths
    assert responses[ids[0]][1] == pytest.approx(after[0, : lengths[0]].tolist(), rel=1e-5, abs=1e-6)


def test_tracker_survives_checkpoint_and_resume(variant_tiny_vlm, tmp_path, scripted_reward, cpu_trainer):
    weights = scripted_reward([1.0, 0.0, 0.0, 1.0])
    rows = make_items("count_shapes", 4, seed=0)
    loader = DataLoader([rows] * 3, batch_size=None, collate_fn=lambda x: x)
    module = _module(variant_tiny_vlm, rewards={"weights": weights}, train_batch_size=3)
    trainer = cpu_trainer(2)
    trainer.fit(module, loader)
    saved = module.tracker.state_dict()
    assert sum(saved["visits"].values()) == 6  # 3 prompts drawn per step, 2 steps
    trainer.save_checkpoint(tmp_path / "spo.ckpt")
    assert torch.load(tmp_path / "spo.ckpt", weights_only=False)["spo_tracker"] == saved

    resumed = _module(variant_tiny_vlm, rewards={"weights": weights}, train_batch_size=3)
    assert len(resumed.tracker) == 0
    seen = []
    original = resumed.compute_advantages

    def recording(rewards, group_ids, rollout):
        seen.append(resumed.tracker.state_dict())  # the tracker the third step starts from
        return original(rewards, group_ids, rollout)

    resumed.compute_advantages = recording
    cpu_trainer(3).fit(resumed, loader, ckpt_path=tmp_path / "spo.ckpt")
    assert seen == [saved]
    assert sum(resumed.tracker.visits.values()) == 9


def test_tiny_config_trains_two_steps(fit_variant):
    logged = fit_variant("spo", "--data.init_args.batch_size=4", "--model.init_args.train_batch_size=2")
    steps = [row for row in logged if row.get("spo/rho_mean")]
    assert len(steps) == 2
    # step 1 sees only fresh prompts: rho 0.96 everywhere, the 0.5 / 0.5 prior, 2 prompts tracked
    assert float(steps[0]["spo/rho_mean"]) == pytest.approx(0.96)
    assert float(steps[0]["spo/p_hat_mean"]) == pytest.approx(0.5)
    assert float(steps[0]["spo/tracked_prompts"]) == 2.0
