"""GRPOModule: config validation, the update's arithmetic on fixed rollouts, hooks, learning."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from lightning.pytorch.loggers import Logger

from mmpo.algos.grpo import GRPOModule
from mmpo.core import LossParts
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import make_items
from mmpo.training.config import AdvantageConfig, LossConfig, OptimConfig, SamplingConfig, merged_settings
from mmpo.vlm.factory import build_tiny_vlm
from mmpo.vlm.logprobs import completion_hidden_states, completion_log_probs
from mmpo.vlm.processing import vision_token_ids
from mmpo.vlm.rollout import HFGenerateEngine

CORPUS = [SYSTEM_PROMPT, "How many shapes? <think>3 shapes.</think><answer>3</answer> left right 0123456789"] * 20


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=CORPUS, vocab_size=350, hidden_size=64,
                              intermediate_size=128))


def _rows(n=2):
    return make_items("count_shapes", n, seed=0)


class FixedRolloutGRPO(GRPOModule):
    """GRPO on a given rollout and given rewards (set as attributes after construction), and
    SGD(lr=1) so that one update moves the weights by exactly minus the gradient."""

    fixed_rollout = None
    fixed_rewards = None

    def build_rollout(self, rows):
        return self.fixed_rollout

    def compute_rewards(self, rollout):
        return self.fixed_rewards.clone(), {}

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=1.0)


def _fixed_rollout(path, rows, *, num_samples=3, max_new_tokens=5, seed=0):
    module = GRPOModule(path, sampling=SamplingConfig(num_generations=num_samples),
                        loss=LossConfig(beta=0.0))
    torch.manual_seed(seed)
    rollout = HFGenerateEngine(module.model, module.processor).generate(
        rows, num_samples=num_samples, max_new_tokens=max_new_tokens
    )
    # unequal completion lengths (as if EOS came early): the normalisers then matter
    n = len(rollout)
    lengths = (torch.arange(n) % max_new_tokens) + 1
    keep = torch.arange(rollout.completion_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    rollout.completion_mask = rollout.completion_mask * keep
    rollout.completion_ids = rollout.completion_ids.masked_fill(~keep, module.processor.tokenizer.pad_token_id)
    return rollout


def _fit_one_step(module, rows, **trainer_kwargs):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs)
    trainer.fit(module, DataLoader([rows], batch_size=None, collate_fn=lambda x: x))
    return module


def _params(module):
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


@pytest.fixture(scope="module")
def fixed(tiny_path):
    rows = _rows(2)
    rollout = _fixed_rollout(tiny_path, rows)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0])
    return rows, rollout, rewards


def _run(tiny_path, fixed, **settings):
    rows, rollout, rewards = fixed
    module = FixedRolloutGRPO(tiny_path, **merged_settings(
        {"sampling": {"num_generations": 3}, "optim": {"max_grad_norm": 0.0}, "loss": {"beta": 0.0}}, settings))
    module.fixed_rollout, module.fixed_rewards = rollout, rewards
    before = _params(module)
    _fit_one_step(module, rows)
    return module, {n: before[n] - p for n, p in _params(module).items()}  # = gradient (SGD, lr 1)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"sampling": {"num_generations": 1}}, "num_generations must be >= 2"),
        ({"optim": {"lr": 0.0}}, "lr must be > 0"),
        ({"loss": {"name": "nope"}}, r"unknown loss 'nope'; valid: \['aspo', "),
        ({"loss": {"agg": "mean"}}, "unknown agg 'mean'; valid:"),
        ({"advantage": {"name": "gae2"}}, "unknown advantage 'gae2'; valid:"),
        ({"loss": {"kl_kind": "k4"}}, "unknown kl_kind"),
        ({"optim": {"mu": 0}}, "mu"),
        ({"optim": {"minibatch_size": 6, "micro_batch_size": 4}},
         r"micro_batch_size 4 must divide minibatch_size 6; valid: \[1, 2, 3, 6\]"),
        ({"loss": {"settings": {"bogus": 1}}}, "bogus"),
    ],
)
def test_bad_settings_fail_with_clear_messages(tiny_path, settings, message):
    with pytest.raises(ValueError, match=message):
        GRPOModule(tiny_path, **settings)


def test_minibatch_must_divide_rollout(tiny_path, fixed):
    module = GRPOModule(tiny_path, sampling=SamplingConfig(num_generations=3), optim=OptimConfig(minibatch_size=4))
    with pytest.raises(ValueError, match=r"minibatch_size 4 must divide the rollout size 6 \(2 prompts x "
                                         r"num_generations 3\); valid: \[1, 2, 3, 6\]"):
        module._check_batch_size(6, 2)


# ----------------------------------------------------------------------------- the update


def test_on_policy_gradient_is_the_hand_computed_policy_gradient(tiny_path, fixed):
    """mu = 1, beta = 0, token-mean: ratio = 1, so grad = grad of -sum_it A_i logp_it / num_tokens."""
    rows, rollout, rewards = fixed
    module, step = _run(tiny_path, fixed)
    # GRPO advantages by hand: group 0 rewards (1, 0, 0.5): mean 0.5, unbiased std 0.5
    # -> (1, -1, 0); group 1 (0, 1, 1): mean 2/3, std sqrt(1/3) -> (-2/3, 1/3, 1/3) / 0.57735
    expected_adv = torch.tensor([1.0, -1.0, 0.0, -2 / 3 / 3**-0.5, 1 / 3 / 3**-0.5, 1 / 3 / 3**-0.5])
    reference = GRPOModule(tiny_path, sampling=SamplingConfig(num_generations=3),
                           loss=LossConfig(beta=0.0)).model
    reference.train()
    log_probs, _ = completion_log_probs(reference, rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask)
    mask = rollout.completion_mask.float()
    adv = expected_adv  # the std eps 1e-6 changes these by < 2e-6 relative, below the tolerance
    loss = -(adv.unsqueeze(-1) * log_probs * mask).sum() / mask.sum()
    loss.backward()
    for name, p in reference.named_parameters():
        expected = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(step[name], expected, atol=2e-6, rtol=1e-4, msg=name)
    # the logged loss is -mean_t(A) over real tokens (ratio 1); the hand value:
    hand = float(-(adv.unsqueeze(-1) * mask).sum() / mask.sum())
    assert module.last_metrics["losses/policy"] == pytest.approx(hand, abs=1e-6)
    assert module.last_metrics["rewards/frac_zero_std"] == 0.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batching_does_not_change_the_update(tiny_path, fixed, agg):
    """Global normalisation: 6 completions in one pass == 6 micro-batches of 1."""
    _, whole = _run(tiny_path, fixed, loss={"agg": agg})
    _, split = _run(tiny_path, fixed, loss={"agg": agg}, optim={"micro_batch_size": 1})
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=1e-5, msg=name)


def test_kl_to_identical_reference_is_zero_with_zero_gradient(tiny_path, fixed):
    """At the first step policy == reference: k3 = 0 and its gradient is 0."""
    module, with_kl = _run(tiny_path, fixed, loss={"beta": 0.5})
    _, without = _run(tiny_path, fixed, loss={"beta": 0.0})
    assert module.last_metrics["kl"] == pytest.approx(0.0, abs=1e-7)
    assert module.last_metrics["losses/kl"] == pytest.approx(0.0, abs=1e-7)
    for name in with_kl:
        torch.testing.assert_close(with_kl[name], without[name], atol=1e-7, rtol=1e-6, msg=name)


def test_inner_epochs_use_old_log_probs_and_clip(tiny_path, fixed, hand_grpo_advantages):
    """mu = 2 over the whole rollout with SGD(lr=1). Epoch 1 is on the old policy (ratio 1,
    nothing clipped). Epoch 2 sees ratio = pi_1 / pi_old, where pi_1 is one SGD step away: the
    step is large, so ratios leave [1 - 0.2, 1 + 0.28] on some tokens. The logged metrics (means
    over the two optimizer steps) must equal the values computed here from log-probs recorded
    before and after a hand-made first step."""
    rows, rollout, rewards = fixed
    clip_low, clip_high = 0.2, 0.28
    module, _ = _run(tiny_path, fixed, optim={"mu": 2}, loss={"clip_low": clip_low, "clip_high": clip_high})
    metrics = module.last_metrics

    # by hand: the old log-probs, the first (on-policy) SGD step, the log-probs after it
    policy = GRPOModule(tiny_path, sampling=SamplingConfig(num_generations=3),
                        loss=LossConfig(beta=0.0)).model
    policy.train()
    mask = rollout.completion_mask.float()
    adv = hand_grpo_advantages(rewards, 3)[:, None].expand_as(mask)
    old, _ = completion_log_probs(policy, rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask)
    (-(adv * old * mask).sum() / mask.sum()).backward()
    with torch.no_grad():
        for p in policy.parameters():
            if p.grad is not None:
                p -= p.grad
        new, _ = completion_log_probs(policy, rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask)
    old = old.detach()
    real = mask > 0
    ratio = torch.exp(new - old)
    high = (adv > 0) & (ratio > 1 + clip_high) & real
    low = (adv < 0) & (ratio < 1 - clip_low) & real
    tokens = float(mask.sum())
    # the batch was built to clip, in both directions, but not everywhere; and no ratio sits so
    # close to a bound that float noise between the two computations could flip a token
    assert 0 < int(high.sum()) and 0 < int(low.sum()) and int((high | low).sum()) < tokens
    for bound in (1 - clip_low, 1 + clip_high):
        assert ((ratio[real] - bound).abs() > 1e-4).all()

    # step 1 contributes ratio 1 and no clipping; step 2 the values above
    assert metrics["policy/clipfrac_high"] == pytest.approx(int(high.sum()) / tokens / 2, abs=1e-6)
    assert metrics["policy/clipfrac_low"] == pytest.approx(int(low.sum()) / tokens / 2, abs=1e-6)
    assert metrics["policy/clipfrac"] == pytest.approx(int((high | low).sum()) / tokens / 2, abs=1e-6)
    ratio_mean = float((ratio * mask).sum()) / tokens
    assert metrics["policy/ratio_mean"] == pytest.approx((1.0 + ratio_mean) / 2, rel=1e-4)
    log_ratio = new - old
    approx_kl = float(((torch.expm1(log_ratio) - log_ratio) * mask).sum()) / tokens
    assert metrics["policy/approx_kl"] == pytest.approx(approx_kl / 2, rel=1e-3)


def test_dynamic_sampling_masks_constant_groups(tiny_path, fixed):
    """Group 1 has constant rewards: its completions leave the loss; the update equals the
    update on group 0 alone."""
    rows, rollout, _ = fixed
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 1.0])
    module, filtered = _run(tiny_path, (rows, rollout, rewards), advantage={"dynamic_sampling": True})
    assert module.last_metrics["rewards/dropped_groups"] == 1
    _, group0 = _run(tiny_path, ([rows[0]], rollout.select([0, 1, 2]), rewards[:3]))
    for name in filtered:
        torch.testing.assert_close(filtered[name], group0[name], atol=1e-6, rtol=1e-5, msg=name)


def test_all_groups_filtered_still_counts_the_step_and_changes_nothing(tiny_path, fixed):
    """Every group constant under dynamic sampling: no parameter moves, but the optimizer step
    is counted, so a run bounded by max_steps still ends (it used to loop forever)."""
    rows, rollout, _ = fixed
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    module = FixedRolloutGRPO(tiny_path, sampling=SamplingConfig(num_generations=3),
                              optim=OptimConfig(max_grad_norm=0.0),
                              loss=LossConfig(beta=0.0),
                              advantage=AdvantageConfig(dynamic_sampling=True))
    module.fixed_rollout, module.fixed_rewards = rollout, rewards
    before = _params(module)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader([rows, rows, rows], batch_size=None, collate_fn=lambda x: x))
    assert trainer.global_step == 2
    assert module.last_metrics["rewards/dropped_groups"] == 2
    for name, value in _params(module).items():
        torch.testing.assert_close(value, before[name], atol=0, rtol=0, msg=name)


def test_extra_loss_terms_hook_is_added_with_the_same_normaliser(tiny_path, fixed):
    calls = []

    class WithExtra(FixedRolloutGRPO):
        def extra_loss_terms(self, minibatch, outputs):
            calls.append(len(minibatch))
            # aggregate(ones) over this micro-batch's mask is its share of the global token count
            share = outputs["aggregation"](torch.ones_like(outputs["mask"]), outputs["mask"])
            return 2.0 * share, {"extra/share": share.detach()}

    rows, rollout, rewards = fixed
    module = WithExtra(tiny_path, sampling=SamplingConfig(num_generations=3), loss=LossConfig(beta=0.0),
                       optim=OptimConfig(micro_batch_size=2))
    module.fixed_rollout, module.fixed_rewards = rollout, rewards
    _fit_one_step(module, rows)
    assert calls == [2, 2, 2]
    # the shares of all micro-batches sum to 1, so the extra loss adds exactly 2.0
    assert module.last_metrics["losses/extra"] == pytest.approx(2.0, abs=1e-6)
    assert module.last_metrics["losses/total"] == pytest.approx(module.last_metrics["losses/policy"] + 2.0, abs=1e-5)


def test_extra_loss_terms_named_parts_are_logged_and_summed_once(tiny_path, fixed):
    seen = {}

    class WithParts(FixedRolloutGRPO):
        def extra_loss_terms(self, minibatch, outputs):
            agg = outputs["aggregation"]
            seen.update(mode=agg.mode, tokens=float(agg.global_tokens), seqs=float(agg.global_seqs),
                        norm_len=agg.norm_len, parts=list(outputs["losses"]))
            share = agg(torch.ones_like(outputs["mask"]), outputs["mask"])
            # 3 x share (coefficient 3) and -0.5 x share: together + 2.5 over the step
            return LossParts().add("test/three", share, 3.0).add("test/half", -0.5 * share), {}

    rows, rollout, rewards = fixed
    module = WithParts(tiny_path, sampling=SamplingConfig(num_generations=3), loss=LossConfig(beta=0.0, entropy_coef=0.1),
                       optim=OptimConfig(micro_batch_size=2))
    module.fixed_rollout, module.fixed_rewards = rollout, rewards
    _fit_one_step(module, rows)
    tokens = float(rollout.completion_mask.sum())
    assert seen == {"mode": "token-mean", "tokens": tokens, "seqs": 6.0, "norm_len": module.sampling.max_new_tokens,
                    "parts": ["policy", "kl", "entropy"]}
    m = module.last_metrics
    # each part is logged unweighted; the shares of the micro-batches sum to 1
    assert m["losses/test/three"] == pytest.approx(1.0, abs=1e-6)
    assert m["losses/test/half"] == pytest.approx(-0.5, abs=1e-6)
    assert m["losses/extra"] == pytest.approx(2.5, abs=1e-6)
    assert m["losses/kl"] == 0.0
    # total = policy - entropy_coef * entropy + 3 * 1 - 0.5
    expected = m["losses/policy"] - 0.1 * m["losses/entropy"] + 2.5
    assert m["losses/total"] == pytest.approx(expected, abs=1e-5)


# ----------------------------------------------------------------------------- learning


def test_grpo_increases_a_learnable_reward(tiny_path):
    """Reward = fraction of completion tokens in the lower half of the vocabulary (about 0.5 for
    the random model); GRPO must raise it."""

    class TokenReward(GRPOModule):
        def compute_rewards(self, rollout):
            mask = rollout.completion_mask.float()
            low = rollout.completion_ids < self.model.config.text_config.vocab_size // 2
            hits = (low.float() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            return hits, {"rewards/token/mean": float(hits.mean())}

    module = TokenReward(tiny_path, sampling=SamplingConfig(num_generations=4, max_new_tokens=4),
                         optim=OptimConfig(lr=3e-2), loss=LossConfig(beta=0.0), seed=0)
    rows = _rows(2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=12, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    history = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            history.append(pl_module.last_metrics["rewards/token/mean"])

    trainer.callbacks.append(Record())
    trainer.fit(module, DataLoader([rows] * 12, batch_size=None, collate_fn=lambda x: x))
    assert len(history) == 12
    first, last = sum(history[:3]) / 3, sum(history[-3:]) / 3
    assert last > first + 0.2, history


def test_rng_state_survives_a_weights_only_checkpoint(tmp_path):
    import random

    import numpy as np

    from mmpo.algos.config import rng_state, set_rng_state

    torch.save({"rng": rng_state()}, tmp_path / "rng.pt")
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected


def test_dynamic_sampling_resamples_constant_groups(tiny_path):
    """DAPO refill: a group whose rewards all agree is sampled again and replaced when the new
    group varies; the rollout keeps its size."""
    calls = []

    class FirstCallConstant(GRPOModule):
        def compute_rewards(self, rollout):
            calls.append(len(rollout))
            # reward: does the completion start with an even token id (varies on a random model);
            # on the first call prompt 0's group is forced constant
            rewards = (rollout.completion_ids[:, 0] % 2 == 0).float()
            if len(calls) == 1:
                rewards[:4] = 1.0  # prompt 0's group: (1, 1, 1, 1), no signal
                rewards[4:] = torch.tensor([0.0, 1.0, 1.0, 1.0])  # prompt 1's group varies
            return rewards, {}

    module = FirstCallConstant(tiny_path, sampling=SamplingConfig(num_generations=4, max_new_tokens=3),
                               loss=LossConfig(beta=0.0),
                               advantage=AdvantageConfig(dynamic_sampling=True, dynamic_sampling_retries=3),
                               seed=1)
    _fit_one_step(module, _rows(2))
    assert calls[0] == 8 and all(n == 4 for n in calls[1:])  # only prompt 0 was sampled again
    metrics = module.last_metrics
    assert metrics["rewards/resampled_groups"] == 1
    assert metrics["rewards/dropped_groups"] == 0
    assert metrics["rewards/frac_zero_std"] == 0.0


# ----------------------------------------------------------------------------- rollout IS correction


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_engine_log_probs_equal_the_trainers(tiny_path, temperature, top_p):
    """HF generate's own log-probs of the sampled tokens match the training forward at the same
    temperature, renormalised over the tokens the sampler may draw: vision tokens are suppressed, so
    log pi_engine = log pi_trainer - log(1 - sum_vision pi_trainer). Top-p renormalises further over the
    nucleus, so there they are >= that."""
    module = GRPOModule(tiny_path, sampling=SamplingConfig(num_generations=3),
                        loss=LossConfig(beta=0.0))
    engine = HFGenerateEngine(module.model, module.processor)
    sampling = dict(num_samples=3, max_new_tokens=6, temperature=temperature, top_p=top_p)
    torch.manual_seed(3)
    plain = engine.generate(_rows(2), **sampling)
    assert "engine_log_probs" not in plain.extras  # off by default: no scores kept
    torch.manual_seed(3)
    rollout = engine.generate(_rows(2), **sampling, return_log_probs=True)
    assert torch.equal(rollout.completion_ids, plain.completion_ids)  # asking for log-probs changes no sample
    engine_lp = rollout.extras["engine_log_probs"]
    mask = rollout.completion_mask.bool()
    assert engine_lp.shape == mask.shape and bool((engine_lp[~mask] == 0).all()) and bool((engine_lp[mask] <= 0).all())
    with torch.no_grad():
        trainer_lp, _ = completion_log_probs(module.model, rollout.prompt_inputs, rollout.completion_ids,
                                             rollout.completion_mask, temperature=temperature)
        hidden = completion_hidden_states(module.model, rollout.prompt_inputs, rollout.completion_ids,
                                          rollout.completion_mask)
        probs = torch.softmax(module.model.get_output_embeddings()(hidden) / temperature, -1)
    vision_mass = probs[..., vision_token_ids(module.processor)].sum(-1)
    assert bool((vision_mass[mask] > 1e-4).all())  # the correction below is not vacuous on this model
    trainer_lp = trainer_lp - torch.log1p(-vision_mass)  # the suppressed distribution's log-probs
    if top_p == 1.0:
        torch.testing.assert_close(engine_lp[mask], trainer_lp[mask], atol=1e-5, rtol=0)
    else:  # log p - log(nucleus mass): never below the full distribution's, above it where the nucleus cut
        assert bool((engine_lp[mask] >= trainer_lp[mask] - 1e-5).all())
        assert bool((engine_lp[mask] > trainer_lp[mask] + 1e-3).any())


def _with_engine_log_probs(tiny_path, fixed, shift):
    """The fixed rollout with engine log-probs = the trainer's + ``shift`` (N, T) on real tokens."""
    rows, rollout, rewards = fixed
    model = GRPOModule(tiny_path, sampling=SamplingConfig(num_generations=3),
                       loss=LossConfig(beta=0.0)).model
    with torch.no_grad():
        trainer_lp, _ = completion_log_probs(model, rollout.prompt_inputs, rollout.completion_ids,
                                             rollout.completion_mask)
    engine = (trainer_lp + shift) * rollout.completion_mask
    perturbed = rollout.select(torch.arange(len(rollout)))
    perturbed.extras = {**perturbed.extras, "engine_log_probs": engine}
    return (rows, perturbed, rewards), trainer_lp


_ADV = torch.tensor([1.0, -1.0, 0.0, -2 / 3 / 3**-0.5, 1 / 3 / 3**-0.5, 1 / 3 / 3**-0.5])  # grpo of `fixed`


def _hand_gradient(tiny_path, rollout, per_token_loss_of):
    """Gradient of sum(per_token_loss_of(log_probs) * mask) / num_tokens on a fresh copy of the policy."""
    reference = GRPOModule(tiny_path, sampling=SamplingConfig(num_generations=3),
                           loss=LossConfig(beta=0.0)).model
    reference.train()
    log_probs, _ = completion_log_probs(reference, rollout.prompt_inputs, rollout.completion_ids,
                                        rollout.completion_mask)
    mask = rollout.completion_mask.float()
    ((per_token_loss_of(log_probs) * mask).sum() / mask.sum()).backward()
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in reference.named_parameters()}


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_rollout_is_weights_multiply_the_per_token_loss(tiny_path, fixed, mode):
    """On-policy ppo (ratio 1) with perturbed engine log-probs: grad = grad of -sum(w A logp) / tokens,
    w = the truncated / masked pi_old / pi_engine worked out here."""
    n, width = fixed[1].completion_ids.shape
    shift = torch.linspace(-0.9, 0.9, n * width).view(n, width)  # engine log-prob = trainer's + shift
    data, _ = _with_engine_log_probs(tiny_path, fixed, shift)
    mask = data[1].completion_mask.float()
    if mode == "token_truncate":
        weights = torch.exp(-shift).clamp(max=2.0) * mask
    else:  # one weight per sequence, 0 beyond the cap
        seq = torch.exp(-(shift * mask).sum(-1, keepdim=True))
        weights = torch.where(seq > 2.0, torch.zeros_like(seq), seq).expand_as(shift) * mask
    assert 0 < float((weights == 0).logical_and(mask > 0).sum() + (weights == 2.0).sum())  # a bound binds
    module, step = _run(tiny_path, data, rollout_correction={"mode": mode, "cap": 2.0})
    expected = _hand_gradient(tiny_path, data[1], lambda lp: -_ADV.unsqueeze(-1) * weights * lp)
    for name in step:
        torch.testing.assert_close(step[name], expected[name], atol=2e-6, rtol=1e-4, msg=name)
    assert module.last_metrics["rollout_is/mean"] == pytest.approx(
        float((weights * mask).sum() / mask.sum()) if mode == "token_truncate"
        else float(weights.amax(-1).mean()), rel=1e-5)
    # without the correction the same rollout gives the plain policy gradient
    _, plain = _run(tiny_path, data)
    assert any(not torch.allclose(plain[k], step[k]) for k in step)


@pytest.mark.parametrize("mode", ["token_mask", "sequence_truncate"])
def test_rollout_is_update_does_not_depend_on_micro_batching(tiny_path, fixed, mode):
    n, width = fixed[1].completion_ids.shape
    data, _ = _with_engine_log_probs(tiny_path, fixed, torch.linspace(-0.9, 0.9, n * width).view(n, width))
    _, whole = _run(tiny_path, data, rollout_correction={"mode": mode})
    _, split = _run(tiny_path, data, rollout_correction={"mode": mode}, optim={"micro_batch_size": 1})
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=1e-5, msg=name)


def test_rollout_bypass_uses_engine_log_probs_as_old(tiny_path, fixed):
    """Bypass: ratio = pi_theta / pi_engine even on-policy (ppo's clip then bounds the mismatch)."""
    n, width = fixed[1].completion_ids.shape
    shift = torch.linspace(-0.1, 0.1, n * width).view(n, width)  # inside ppo's clip range: no clip binds
    data, _ = _with_engine_log_probs(tiny_path, fixed, shift)
    module, step = _run(tiny_path, data, rollout_correction={"bypass": True})
    rollout = data[1]
    engine = rollout.extras["engine_log_probs"]
    expected = _hand_gradient(tiny_path, rollout, lambda lp: -_ADV.unsqueeze(-1) * torch.exp(lp - engine))
    for name in step:
        torch.testing.assert_close(step[name], expected[name], atol=2e-6, rtol=1e-4, msg=name)
    mask = rollout.completion_mask.float()
    assert module.last_metrics["policy/ratio_mean"] == pytest.approx(
        float((torch.exp(-shift) * mask).sum() / mask.sum()), rel=1e-4)


def test_rollout_bypass_with_gpg_weights_by_the_current_policy(tiny_path, fixed):
    """verl's bypass 'reinforce': loss -A w logp with w = clamp(pi_theta / pi_engine, C), detached."""
    n, width = fixed[1].completion_ids.shape
    shift = torch.linspace(-0.9, 0.9, n * width).view(n, width)
    data, _ = _with_engine_log_probs(tiny_path, fixed, shift)
    _, step = _run(tiny_path, data, loss={"name": "gpg"},
                   rollout_correction={"bypass": True, "mode": "token_truncate", "cap": 1.5})
    weights = torch.exp(-shift).clamp(max=1.5) * data[1].completion_mask
    expected = _hand_gradient(tiny_path, data[1], lambda lp: -_ADV.unsqueeze(-1) * weights * lp)
    for name in step:
        torch.testing.assert_close(step[name], expected[name], atol=2e-6, rtol=1e-4, msg=name)


def test_rollout_bypass_skips_the_old_log_prob_pass(tiny_path, fixed, monkeypatch):
    """mu = 2 needs old log-probs: without bypass the trainer recomputes them, with bypass never."""
    data, _ = _with_engine_log_probs(tiny_path, fixed, torch.zeros(fixed[1].completion_ids.shape))
    calls = []
    original = GRPOModule._log_probs_no_grad
    monkeypatch.setattr(GRPOModule, "_log_probs_no_grad", lambda *a, **k: calls.append(1) or original(*a, **k))
    _run(tiny_path, data, optim={"mu": 2})
    assert calls == [1]
    _run(tiny_path, data, optim={"mu": 2}, rollout_correction={"bypass": True})
    assert calls == [1]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"rollout_correction": {"mode": "token"}}, "unknown rollout_is mode 'token'"),
        ({"rollout_correction": {"mode": "token_mask", "cap": 0.0}}, "rollout_is_cap must be > 0"),
        ({"rollout_correction": {"mode": "token_mask", "bypass": True}}, "needs the ratio-free loss 'gpg'"),
    ],
)
def test_bad_rollout_correction_settings(tiny_path, settings, message):
    with pytest.raises(ValueError, match=message):
        GRPOModule(tiny_path, **settings)


def test_rollout_is_without_engine_log_probs_fails_clearly(tiny_path, fixed):
    with pytest.raises(RuntimeError, match="return_log_probs=True"):
        _run(tiny_path, fixed, rollout_correction={"mode": "token_truncate"})


# ----------------------------------------------------------------------------- cheap levers


def test_entropy_is_computed_only_on_steps_that_log_and_changes_no_update(tiny_path, fixed, monkeypatch):
    """entropy_coef 0: the entropy is a diagnostic, computed on logging steps only (here every 2nd of
    2 steps: Lightning logs at steps whose count divides log_every_n_steps); the update is the same."""
    rows, rollout, rewards = fixed
    asked = []
    original = GRPOModule.sequence_log_probs

    def recording(self, model, part, *, with_entropy=False):
        asked.append(with_entropy)
        return original(self, model, part, with_entropy=with_entropy)

    monkeypatch.setattr(GRPOModule, "sequence_log_probs", recording)
    updates = []
    for every in (2, 1):
        asked.clear()
        module = FixedRolloutGRPO(tiny_path, sampling=SamplingConfig(num_generations=3),
                                  optim=OptimConfig(max_grad_norm=0.0),
                                  loss=LossConfig(beta=0.0))
        module.fixed_rollout, module.fixed_rewards = rollout, rewards
        before = _params(module)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=every)
        trainer.fit(module, DataLoader([rows, rows], batch_size=None, collate_fn=lambda x: x))
        updates.append({n: before[n] - p for n, p in _params(module).items()})
        # one on-policy forward per step: entropy on step 2 only when logging every 2 steps
        assert asked == ([False, True] if every == 2 else [True, True])
        assert ("entropy" in module.last_metrics) and ("losses/entropy" in module.last_metrics)
    for name in updates[0]:
        torch.testing.assert_close(updates[0][name], updates[1][name], atol=0, rtol=0)


def test_adamw_is_torchs_fused_kernel_on_cpu_with_the_hand_computed_first_step():
    from mmpo.training.optim import make_optimizer

    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    optimizer = make_optimizer([p], lr=0.1, weight_decay=0.01, fused=True)["optimizer"]
    assert optimizer.defaults["fused"] is True
    p.grad = torch.tensor([0.5, -0.25])
    optimizer.step()
    # first AdamW step: p * (1 - lr * wd) - lr * m_hat / (sqrt(v_hat) + eps), m_hat = g, sqrt(v_hat) = |g|
    # 1.0 * 0.999 - 0.1 * 0.5 / 0.5 = 0.899;  -2.0 * 0.999 - 0.1 * (-0.25) / 0.25 = -1.898
    torch.testing.assert_close(p.detach(), torch.tensor([0.899, -1.898]), atol=1e-6, rtol=0)


def test_diagnostics_go_to_lightning_on_logging_steps_shared_and_monitored_keys_every_step(tiny_path, fixed):
    from lightning.pytorch.callbacks import ModelCheckpoint

    rows, rollout, rewards = fixed
    module = FixedRolloutGRPO(tiny_path, sampling=SamplingConfig(num_generations=3),
                              optim=OptimConfig(max_grad_norm=0.0),
                              loss=LossConfig(beta=0.0))
    module.fixed_rollout, module.fixed_rewards = rollout, rewards
    monitor = ModelCheckpoint(monitor="response/length_mean", save_top_k=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=50, callbacks=[monitor])
    trainer.fit(module, DataLoader([rows], batch_size=None, collate_fn=lambda x: x))
    logged = set(trainer.callback_metrics)
    shared = {"rewards/total/mean", "losses/policy", "policy/clipfrac", "policy/approx_kl", "perf/skipped_steps"}
    assert shared | {"response/length_mean"} <= logged  # step 1 of 50 does not log: only these
    assert "lr" not in logged and "entropy" not in logged and "entropy" not in module.last_metrics
    assert "lr" in module.last_metrics  # still computed, for the caller


class _CapturingLogger(Logger):
    """Every (step, metrics) Lightning hands its loggers."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def _logged_run(tiny_path, fixed, every: int) -> tuple[_CapturingLogger, GRPOModule]:
    rows, rollout, rewards = fixed
    module = FixedRolloutGRPO(tiny_path, sampling=SamplingConfig(num_generations=3), optim=OptimConfig(lr=1e-3),
                              loss=LossConfig(beta=0.0))
    module.fixed_rollout, module.fixed_rewards = rollout, rewards
    logger = _CapturingLogger()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=logger, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=every)
    trainer.fit(module, DataLoader([rows, rows], batch_size=None, collate_fn=lambda x: x))
    return logger, module


def test_diagnostics_merged_into_lightnings_logger_call_have_the_self_log_values(tiny_path, fixed, monkeypatch):
    """The ~25 diagnostics skip self.log (mmpo.training.step_logging) yet the loggers get what self.log gave:
    one call per logging step with every metric, each the float32 value self.log stores, at the same step,
    equal to a run that sends them through self.log."""
    import mmpo.algos.grpo as grpo

    logger, module = _logged_run(tiny_path, fixed, every=1)
    assert [step for step, _ in logger.calls] == [0, 1]  # one call per step (one metrics.csv row)
    last = logger.calls[-1][1]
    assert set(last) == set(module.last_metrics) | {"epoch"} and len(module.last_metrics) > 20
    for key, value in module.last_metrics.items():
        assert last[key] == torch.tensor(float(value), dtype=torch.float32).item(), key

    def through_self_log(module, metrics, order):  # the path before: every key through self.log
        if metrics:
            module.log_dict(dict(metrics), on_step=True, on_epoch=False)

    monkeypatch.setattr(grpo, "log_with_step_metrics", through_self_log)
    reference, _ = _logged_run(tiny_path, fixed, every=1)
    assert [step for step, _ in reference.calls] == [0, 1]
    for (_, got), (_, expected) in zip(logger.calls, reference.calls):
        assert set(got) == set(expected)
        timings = {"perf/rollout_s", "perf/update_s", "perf/tokens_per_s"}  # wall-clock: differ between runs
        assert {k: v for k, v in got.items() if k not in timings} == {
            k: float(v) for k, v in expected.items() if k not in timings}
    monkeypatch.undo()

    # log_every_n_steps 2: step index 0 writes nothing, step 1 writes everything
    sparse, module = _logged_run(tiny_path, fixed, every=2)
    assert [step for step, _ in sparse.calls] == [1]
    assert set(sparse.calls[0][1]) == set(module.last_metrics) | {"epoch"}
