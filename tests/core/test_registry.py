"""Registries: lookup by str or enum, loud unknown / duplicate names, unknown settings."""

import pytest
import torch

from mmpo.core import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageEstimator,
    PolicyLoss,
    Registry,
    compute_advantages,
    compute_advantages_with_metrics,
    policy_loss,
    register_advantage_estimator,
    register_policy_loss,
)


def test_every_enum_member_is_registered():
    assert sorted(m.value for m in AdvantageEstimator) == ADVANTAGE_ESTIMATORS.names()
    assert sorted(m.value for m in PolicyLoss) == POLICY_LOSSES.names()


def test_enum_and_string_lookup_agree():
    assert ADVANTAGE_ESTIMATORS.get("grpo") is ADVANTAGE_ESTIMATORS.get(AdvantageEstimator.GRPO)
    assert POLICY_LOSSES.get("cispo") is POLICY_LOSSES.get(PolicyLoss.CISPO)


def test_unknown_advantage_name_lists_valid_names():
    with pytest.raises(ValueError) as err:
        compute_advantages("grpoo", torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    message = str(err.value)
    assert "'grpoo'" in message
    for name in ("drgrpo", "grpo", "mapo", "mapo_apd", "mapo_random_lambda", "rloo"):
        assert name in message


def test_unknown_policy_loss_lists_valid_names():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError) as err:
        policy_loss("ppo2", x, x, torch.zeros(1), torch.ones(1, 2))
    for name in ("aspo", "cispo", "dcpo", "gmpo", "gppo", "gspo", "ppo"):
        assert name in str(err.value)


def test_duplicate_names_raise_and_list_registered_names():
    with pytest.raises(ValueError, match="duplicate advantage estimator name 'grpo'.*rloo"):
        register_advantage_estimator("grpo")(lambda rewards, index: (rewards, {}))
    with pytest.raises(ValueError, match="duplicate policy loss name 'ppo'.*gspo"):
        register_policy_loss(PolicyLoss.PPO)(lambda *a, **k: None)
    # the failed registration left the original in place
    assert POLICY_LOSSES.get("ppo").__name__ == "ppo_loss"


def test_local_registry_register_get_contains():
    reg: Registry = Registry("widget")

    @reg.register("a")
    def widget_a():
        return 1

    assert reg.get("a") is widget_a and "a" in reg and "b" not in reg and len(reg) == 1
    with pytest.raises(ValueError, match=r"unknown widget 'b'; valid names: \['a'\]"):
        reg.get("b")
    with pytest.raises(TypeError):
        reg.register(3)  # type: ignore[arg-type]


def test_unknown_settings_are_named():
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['epsilon'\].*\['eps', 'unbiased_std'\]"):
        compute_advantages("grpo", torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), epsilon=1e-4)
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['clip_ratio'\]"):
        policy_loss("ppo", x, x, torch.zeros(1), torch.ones(1, 2), clip_ratio=0.2)


def test_user_registered_estimator_and_loss_work_end_to_end():
    @register_advantage_estimator("_test_sign")
    def sign_advantages(rewards, index, *, scale: float = 1.0):
        return scale * torch.sign(rewards - index.mean(rewards)[index.inverse]), {"advantages/custom": 1.0}

    @register_policy_loss("_test_reinforce")
    def reinforce_loss(log_probs, old_log_probs, advantages, mask, *, aggregation, log_ratio_clamp):
        return aggregation(-advantages * log_probs, mask), {}

    try:
        adv, metrics = compute_advantages_with_metrics(
            "_test_sign", torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1]), scale=2.0
        )
        # group 0 mean 0.5 -> signs +1, -1 (x2) ; group 1 constant -> 0
        assert adv.tolist() == [2.0, -2.0, 0.0, 0.0]
        assert metrics["advantages/custom"] == 1.0 and metrics["rewards/frac_zero_std"] == 0.5
        with pytest.raises(ValueError, match=r"accepted settings: \['scale'\]"):
            compute_advantages("_test_sign", torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), eps=1.0)
        lp = torch.tensor([[-1.0, -2.0]])
        loss, _ = policy_loss("_test_reinforce", lp, lp, torch.tensor([2.0]), torch.ones(1, 2),
                              agg="seq-mean-token-sum")
        # -2 * (-1 - 2) = 6
        assert loss.item() == 6.0
    finally:
        ADVANTAGE_ESTIMATORS.unregister("_test_sign")
        POLICY_LOSSES.unregister("_test_reinforce")
    assert "_test_sign" not in ADVANTAGE_ESTIMATORS
