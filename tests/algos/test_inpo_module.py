"""INPO online: the oracle's pairs (reward then brevity, a pairwise judge), the first step's loss
(eta / 2)^2, the previous-iterate anchor (refreshed per iteration, kept in checkpoints), and a 2-step
`mmpo fit` of inpo_tiny.yaml."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from mmpo.algos.inpo import INPOModule, judge_pairs, select_pairs
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus, make_items
from mmpo.training.config import OptimConfig, RewardConfig, SamplingConfig
from mmpo.vlm.factory import build_tiny_vlm
from mmpo.vlm.rollout import Rollout


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    texts = [SYSTEM_PROMPT, *corpus(["arithmetic"], n=20)]
    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=texts, vocab_size=400, hidden_size=64,
                              intermediate_size=128))


@pytest.fixture
def first_judge(tmp_path):
    """A judge file that always prefers the first completion."""
    path = tmp_path / "judge.py"
    path.write_text("def judge(prompts, completions):\n    return [0] * len(prompts)\n")
    return f"{path}:judge"


def test_select_pairs_reward_then_brevity():
    # group 0: rewards 1, 0, 1, 0 with lengths 5, 3, 4, 6 -> best: reward 1 and shorter (pos 2), worst: reward 0
    #          and longer (pos 3); group 1: all reward 0, lengths 2, 2 -> tie, no pair; group 2: 0 vs 0, lengths
    #          7 vs 4 -> brevity decides (pos 7 chosen, 6 rejected), without brevity it is a tie
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    lengths = torch.tensor([5, 3, 4, 6, 2, 2, 7, 4])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    assert select_pairs(rewards, lengths, groups) == [(2, 3), (7, 6)]
    assert select_pairs(rewards, lengths, groups, brevity=False) == [(0, 1)]


def test_judge_pairs_follow_trls_convention():
    rollout = Rollout(rows=[{"problem": "p0"}] * 2 + [{"problem": "p1"}] * 2 + [{"problem": "p2"}] * 2,
                      group_ids=torch.tensor([0, 0, 1, 1, 2, 2]), prompt_inputs=None, completion_ids=torch.zeros(6, 1),
                      completion_mask=torch.ones(6, 1), texts=["a", "b", "c", "d", "e", "f"])
    seen = {}

    def judge(prompts, completions):
        seen.update(prompts=prompts, completions=completions)
        return [1, -1, 0]

    assert judge_pairs(judge, rollout) == [(1, 0), (4, 5)]  # p0: b preferred; p1: no preference; p2: e preferred
    assert seen == {"prompts": ["p0", "p1", "p2"], "completions": [["a", "b"], ["c", "d"], ["e", "f"]]}
    with pytest.raises(ValueError, match="one of 0, 1, -1 per prompt"):
        judge_pairs(lambda prompts, completions: [0.7, 0, 0], rollout)


def test_first_step_loss_and_the_anchor_iterations(tiny_path, first_judge):
    module = INPOModule(tiny_path, eta=1.0, tau=0.5, iteration_steps=2,
                        sampling=SamplingConfig(num_generations=2, max_new_tokens=5),
                        optim=OptimConfig(lr=1e-2), judge=first_judge,
                        rewards=RewardConfig(timeout_s=None))
    rows = make_items("arithmetic", 2, seed=0)
    losses = []
    module.training_step = _recording(module.training_step, losses)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    anchors = []
    module.on_train_batch_end = _after(module.on_train_batch_end, lambda: anchors.append(_same(module)))
    trainer.fit(module, DataLoader([rows] * 3, batch_size=None, collate_fn=lambda x: x))
    # step 1: policy == pi_ref == pi_t, so h = 0 and the loss is (eta / 2)^2 = 0.25 for every pair
    assert losses[0] == pytest.approx(0.25, abs=1e-5)
    # the anchor follows the policy after steps 2 (iteration_steps), not after steps 1 and 3
    assert anchors == [False, True, False]
    assert not _same(module, "reference")  # pi_ref stays the initial policy
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    fresh = INPOModule(tiny_path, eta=1.0, tau=0.5, sampling=SamplingConfig(num_generations=2), judge=first_judge)
    fresh.on_load_checkpoint(checkpoint)
    for a, b in zip(fresh.anchor_model.parameters(), module.anchor_model.parameters()):
        assert torch.equal(a, b)


def _same(module: INPOModule, which: str = "anchor") -> bool:
    frozen = module.anchor_model if which == "anchor" else module.reference_model
    return all(torch.equal(a, b) for a, b in zip(frozen.parameters(), module.model.parameters()))


def _recording(step, losses):
    def wrapped(batch, batch_idx):
        loss = step(batch, batch_idx)
        losses.append(float(loss.detach()))
        return loss
    return wrapped


def _after(hook, then):
    def wrapped(*args, **kwargs):
        hook(*args, **kwargs)
        then()
    return wrapped


def test_config_errors(tiny_path, first_judge):
    with pytest.raises(ValueError, match=r"eta \* tau <= 1"):
        INPOModule(tiny_path, eta=2.0, tau=1.0)
    with pytest.raises(ValueError, match="num_generations must be 2"):
        INPOModule(tiny_path, judge=first_judge, sampling=SamplingConfig(num_generations=4))
    with pytest.raises(ValueError, match="iteration_steps must be >= 1"):
        INPOModule(tiny_path, iteration_steps=0)


def test_inpo_tiny_config_fits_two_steps(tiny_path, tmp_path, first_judge, fit_preference_config):
    rows = fit_preference_config("inpo_tiny.yaml", tiny_path, tmp_path, "--model.init_args.sampling.max_new_tokens=6",
                                 "--model.init_args.sampling.num_generations=2", f"--model.init_args.judge={first_judge}",
                                 "--model.init_args.sampling.val_max_new_tokens=4")
    steps = [r for r in rows if r.get("losses/preference")]
    assert len(steps) == 2
    assert [float(r["pairs/count"]) for r in steps] == [8.0, 8.0]  # the judge prefers one of every prompt's two
    assert float(steps[0]["losses/preference"]) == pytest.approx(1.0, abs=1e-5)  # (eta / 2)^2 with eta 2


def test_a_checkpoint_at_the_end_of_an_iteration_holds_the_new_anchor(tiny_path, first_judge):
    """ModelCheckpoint saves in its on_train_batch_end, which Lightning calls before the module's (where pi_t
    is refreshed): the checkpoint taken after step 2 (iteration_steps 2) must hold the refreshed pi_t, or a
    run resumed from it samples step 3 from the previous iteration's anchor."""
    module = INPOModule(tiny_path, eta=1.0, tau=0.5, iteration_steps=2,
                        sampling=SamplingConfig(num_generations=2, max_new_tokens=5),
                        optim=OptimConfig(lr=1e-2), judge=first_judge,
                        rewards=RewardConfig(timeout_s=None))
    saved = {}

    class SaveLikeModelCheckpoint(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            checkpoint: dict = {}
            pl_module.on_save_checkpoint(checkpoint)
            anchor = {k: v.clone() for k, v in checkpoint["mmpo_inpo_anchor"].items()}  # on CPU: the live tensors
            saved[trainer.global_step] = {**checkpoint, "mmpo_inpo_anchor": anchor}

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[SaveLikeModelCheckpoint()])
    trainer.fit(module, DataLoader([make_items("arithmetic", 2, seed=0)] * 2, batch_size=None, collate_fn=lambda x: x))
    policy = module.model.state_dict()
    assert saved[1]["mmpo_inpo_anchor_step"] is None  # step 1: mid-iteration, the initial anchor
    assert not all(torch.equal(saved[1]["mmpo_inpo_anchor"][k], v) for k, v in policy.items())
    assert saved[2]["mmpo_inpo_anchor_step"] == 2
    assert all(torch.equal(saved[2]["mmpo_inpo_anchor"][k], v) for k, v in policy.items())


def test_a_skipped_step_then_a_trained_step_log_alike(tiny_path, first_judge):
    """A step where the oracle prefers nothing (skipped) followed by a trained step: both log
    rewards/total/mean with the same arguments (Lightning refused the second one before), the second trains."""
    module = INPOModule(tiny_path, eta=1.0, tau=0.5, sampling=SamplingConfig(num_generations=2, max_new_tokens=4),
                        optim=OptimConfig(lr=1e-2), rewards=RewardConfig(timeout_s=None))
    calls = []

    def scripted_pairs(rollout):
        calls.append(len(calls))
        pairs = [] if len(calls) == 1 else [(0, 1)]
        return pairs, {"rewards/total/mean": 0.5 * len(calls)}

    module.preference_pairs = scripted_pairs
    losses = []
    module.training_step = _recording_optional(module.training_step, losses)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    rows = make_items("arithmetic", 2, seed=0)
    trainer.fit(module, DataLoader([rows] * 2, batch_size=None, collate_fn=lambda x: x))
    assert calls == [0, 1] and losses[0] is None and losses[1] == pytest.approx(0.25, abs=1e-5)
    assert float(trainer.callback_metrics["rewards/total/mean"]) == 1.0


def _recording_optional(step, losses):
    def wrapped(batch, batch_idx):
        loss = step(batch, batch_idx)
        losses.append(None if loss is None else float(loss.detach()))
        return loss
    return wrapped
