"""PVPO (arXiv 2508.21104): the static-baseline estimator with hand-computed values, the baseline
table, expert injection, the module's step on a scripted reward (trivial filter, injected traces),
the table's checkpoint / resume, and the tiny config through `mmpo fit`."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from mmpo.algos.pvpo import BaselineTable, inject_completions
from mmpo.core import ADVANTAGE_ESTIMATORS, compute_advantages, compute_advantages_with_metrics
from mmpo.data.synthetic import make_items
from mmpo.training.config import LossConfig, RewardConfig, SamplingConfig, merged_settings


def test_static_baseline_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    values = torch.tensor([0.25, 0.25, 0.75, 0.75])
    adv, metrics = compute_advantages_with_metrics("pvpo", rewards, groups, static_values=values)
    # r - V: 1 - 0.25, 0 - 0.25, 0.5 - 0.75, 1 - 0.75 (no group mean, no std)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, 0.25])
    assert metrics["advantages/pvpo_static_value_mean"] == pytest.approx(0.5)
    # a group whose rewards agree still gets a signal (GRPO would give 0): V = 0.25, r = 1, 1
    same = compute_advantages("pvpo", torch.tensor([1.0, 1.0]), torch.tensor([0, 0]),
                              static_values=torch.tensor([0.25, 0.25]))
    assert same.tolist() == [0.75, 0.75]
    assert "pvpo" in ADVANTAGE_ESTIMATORS
    with pytest.raises(ValueError, match="needs the input"):
        compute_advantages("pvpo", rewards, groups)
    with pytest.raises(ValueError, match="shape"):
        compute_advantages("pvpo", rewards, groups, static_values=values[:2])


def test_baseline_table_records_means_and_round_trips():
    table = BaselineTable()
    # prompt "a": rewards 1, 0, 0.1 -> V = 1.1 / 3 = 0.366667, accuracy 1, 0, 0 -> 1/3; "b": 0.9, 0.9, 0.9
    table.record(["a", "b"], torch.tensor([1.0, 0.0, 0.1, 0.9, 0.9, 0.9]), torch.tensor([1.0, 0, 0, 1, 1, 1]),
                 torch.tensor([0, 0, 0, 1, 1, 1]))
    values, accuracy = table.lookup(["b", "a"])
    assert values.tolist() == pytest.approx([0.9, 1.1 / 3]) and accuracy.tolist() == pytest.approx([1.0, 1 / 3])
    table.refreshed_at = 7
    copy = BaselineTable()
    copy.load_state_dict(table.state_dict())
    assert copy.state_dict() == table.state_dict()
    with pytest.raises(KeyError, match="reference pass"):
        table.lookup(["c"])
    assert table.entries(["a", "c"]) == {"a": (pytest.approx(1.1 / 3), pytest.approx(1 / 3))}
    table.merge([{"c": (0.5, 0.0)}, {"c": (0.25, 1.0), "b": (0.0, 0.0)}])  # later tables win a clash
    assert table.values["c"] == 0.25 and table.accuracy["c"] == 1.0 and table.values["b"] == 0.0


def test_inject_completions_replaces_only_the_given_positions(variant_tiny_vlm):
    from mmpo.vlm.factory import load_vlm
    from mmpo.vlm.processing import encode_completions
    from mmpo.vlm.rollout import HFGenerateEngine

    model, processor = load_vlm(variant_tiny_vlm)
    rows = make_items("count_shapes", 2, seed=0)
    torch.manual_seed(0)
    rollout = HFGenerateEngine(model, processor).generate(rows, num_samples=2, max_new_tokens=3)
    trace = rows[1]["expert_trace"]
    out = inject_completions(rollout, [3], [trace], processor, max_length=64)
    ids, mask = encode_completions(processor, [trace], max_length=64)
    n = int(mask.sum())
    assert out.completion_ids[3, :n].tolist() == ids[0, :n].tolist() and int(out.completion_mask[3].sum()) == n
    assert out.texts[3] == trace and out.extras["pvpo_injected"].tolist() == [False, False, False, True]
    for i in range(3):  # the sampled ones are untouched (right-padded to the new width)
        w = rollout.completion_ids.shape[1]
        assert torch.equal(out.completion_ids[i, :w], rollout.completion_ids[i])
        assert int(out.completion_mask[i].sum()) == int(rollout.completion_mask[i].sum())


SOLVED = "count_shapes-train-s0-0"  # the scripted reward solves this prompt always: trivial


@pytest.fixture
def scripted_accuracy(monkeypatch):
    """accuracy = 1 for the SOLVED prompt and for a completion equal to its row's expert trace, else 0."""
    from mmpo.rewards.registry import REWARDS

    def scripted(completions, rows):
        return torch.tensor([float(row["id"] == SOLVED or text == row["expert_trace"])
                             for text, row in zip(completions, rows)])

    monkeypatch.setitem(REWARDS, "accuracy", scripted)


def _module(path, **settings):
    from mmpo.algos.pvpo import PVPOModule

    return PVPOModule(str(path), **merged_settings(dict(
        sampling=SamplingConfig(num_generations=2, max_new_tokens=3), loss=LossConfig(beta=0.0),
        rewards=RewardConfig(timeout_s=None, weights={"accuracy": 1.0})), settings))


def _recording(module, seen):
    original = module.compute_advantages

    def record(rewards, group_ids, rollout):
        adv, metrics = original(rewards, group_ids, rollout)
        seen.append(dict(rewards=rewards.clone(), adv=adv.clone(), mask=rollout.completion_mask.clone(),
                         ids=[r["id"] for r in rollout.rows], texts=list(rollout.texts), metrics=metrics))
        return adv, metrics

    module.compute_advantages = record


def test_step_filters_trivial_injects_traces_and_resumes(variant_tiny_vlm, tmp_path, scripted_accuracy, cpu_trainer):
    rows = make_items("count_shapes", 2, seed=0)  # SOLVED and one the 3-token policy never solves
    loader = DataLoader(rows, batch_size=2, collate_fn=lambda x: x)
    module = _module(variant_tiny_vlm, offline_pass=False)
    passes = []
    estimate = module.estimate_baselines
    module.estimate_baselines = lambda rs, step: passes.append([r["id"] for r in rs]) or estimate(rs, step)
    seen = []
    _recording(module, seen)
    trainer = cpu_trainer(2)
    trainer.fit(module, loader)
    assert passes == [[r["id"] for r in rows]]  # estimated once, on first sight
    # reference pass: SOLVED -> V = 1, accuracy 1 (trivial); the other -> V = 0, accuracy 0 (never solved)
    assert module.baselines.values == {SOLVED: 1.0, rows[1]["id"]: 0.0}
    for record in seen:
        assert record["ids"] == [SOLVED, SOLVED, rows[1]["id"], rows[1]["id"]]
        # the never-solved prompt's last completion is its expert trace, which scores 1
        assert record["texts"][3] == rows[1]["expert_trace"]
        assert record["rewards"].tolist()[2:] == [0.0, 1.0]
        # A = r - V: trivial group 0 (masked out), other group 0 - 0, 1 - 0
        assert record["adv"].tolist() == [0.0, 0.0, 0.0, 1.0]
        assert record["mask"][:2].sum() == 0 and record["mask"][3].sum() > 0
        assert record["metrics"]["pvpo/trivial_frac"] == 0.5
        assert record["metrics"]["pvpo/injected_frac"] == 0.25

    ckpt = tmp_path / "pvpo.ckpt"
    trainer.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=False)["pvpo_baselines"] == module.baselines.state_dict()
    resumed = _module(variant_tiny_vlm, offline_pass=True)
    resumed.estimate_baselines = lambda rs, step: pytest.fail("a resumed run must not re-run the reference pass")
    seen_resumed = []
    _recording(resumed, seen_resumed)
    cpu_trainer(3).fit(resumed, loader, ckpt_path=ckpt)
    assert resumed.baselines.state_dict() == module.baselines.state_dict() and len(seen_resumed) == 1


def test_offline_pass_and_refresh(variant_tiny_vlm, scripted_accuracy, cpu_trainer):
    rows = make_items("count_shapes", 2, seed=0)
    loader = DataLoader(rows, batch_size=2, collate_fn=lambda x: x)
    module = _module(variant_tiny_vlm, refresh_every=2, inject_expert=False)
    steps = []
    estimate = module.estimate_baselines
    module.estimate_baselines = lambda rs, step: steps.append(step) or estimate(rs, step)
    cpu_trainer(3).fit(module, loader)
    # the offline pass over the loader's dataset before step 0, then the refresh at step 2
    assert steps == [0, 2] and module.baselines.refreshed_at == 2


def test_lazy_entries_of_other_ranks_are_merged(variant_tiny_vlm, scripted_accuracy, cpu_trainer, monkeypatch):
    """Under DDP each rank estimates its own prompts lazily; the step shares them (the gather is faked
    here as a second rank that estimated one prompt of its own)."""
    import mmpo.algos.pvpo as pvpo

    sent = []
    monkeypatch.setattr(pvpo, "all_gather_objects",
                        lambda value: sent.append(value) or [value, {"other-rank-prompt": (0.3, 0.25)}])
    rows = make_items("count_shapes", 2, seed=0)
    module = _module(variant_tiny_vlm, offline_pass=False, inject_expert=False)
    cpu_trainer(1).fit(module, DataLoader(rows, batch_size=2, collate_fn=lambda x: x))
    assert sent == [{SOLVED: (1.0, 1.0), rows[1]["id"]: (0.0, 0.0)}]  # this rank's batch entries
    assert module.baselines.entries(["other-rank-prompt"]) == {"other-rank-prompt": (0.3, 0.25)}


def test_settings_are_checked(variant_tiny_vlm):
    with pytest.raises(ValueError, match="'pvpo'"):
        _module(variant_tiny_vlm, advantage={"name": "grpo"})
    with pytest.raises(ValueError, match="rollout_is"):
        _module(variant_tiny_vlm, rollout_correction={"mode": "token_truncate"})


def test_tiny_config_trains_two_steps(fit_variant):
    logged = fit_variant("pvpo", "--model.init_args.sampling.num_generations=2", "--model.init_args.ref_rollouts=2")
    steps = [row for row in logged if row.get("pvpo/static_value_mean")]
    assert len(steps) == 2
    assert all(0.0 <= float(r["pvpo/static_value_mean"]) <= 1.0 for r in steps)
