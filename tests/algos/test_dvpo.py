"""DVPO (mmpo.algos.dvpo): parity of the advantages and the value targets with the official code, hand values of
the value-model targets, and the two tiny configs through `mmpo fit` (value pretraining, then PPO against the
frozen value model)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from mmpo.algos.dvpo import DVPOModule, GlobalValueModule
from mmpo.algos.ppo import VALUE_HEAD_FILE
from mmpo.cli import main
from mmpo.core import masked_whiten, outcome_token_rewards, token_gae
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus
from mmpo.training.config import ValueModelConfig
from mmpo.vlm.factory import build_tiny_vlm
from tiny_vlm_support import tiny_grpo_fit_args

REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------- the official code, transcribed


def _trl_masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def _trl_masked_whiten(values, mask, shift_mean=True):
    # trl (0.x, the version the official code imports): core.masked_whiten with masked_var(unbiased=True)
    mean = _trl_masked_mean(values, mask)
    centered = values - mean
    variance = _trl_masked_mean(centered**2, mask)
    mask_sum = mask.sum()
    variance = variance * (mask_sum / (mask_sum - 1))
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def official_compute_rewards(logprobs, ref_logprobs, kl_coef):
    """microsoft/DKI_LLM dvpo/policy_model_training/policyv1_trainer.py: compute_rewards (kl_penalty "kl")."""
    non_score_rewards = []
    for logprob, ref_logprob in zip(logprobs, ref_logprobs):
        kl = logprob - ref_logprob
        non_score_rewards.append(-kl_coef * kl)
    return torch.stack(non_score_rewards)


def official_compute_advantages(values, rewards, mask, gamma, lam):
    """microsoft/DKI_LLM dvpo/policy_model_training/policyv1_trainer.py: compute_advantages (whiten_rewards off);
    dvpo/value_model_training/vas_trainer.py's is the same loop returning (values, returns)."""
    lastgaelam = 0
    advantages_reversed = []
    gen_len = rewards.shape[-1]
    values = values * mask
    rewards = rewards * mask
    for t in reversed(range(gen_len)):
        nextvalues = values[:, t + 1] if t < gen_len - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1]).transpose(0, 1)
    returns = advantages + values
    advantages = _trl_masked_whiten(advantages, mask)
    return values, advantages, returns


def _right_padded(seed=0):
    g = torch.Generator().manual_seed(seed)
    values, logprobs, ref = (torch.randn(4, 7, generator=g) for _ in range(3))
    lengths = torch.tensor([7, 3, 5, 1])
    mask = (torch.arange(7)[None] < lengths[:, None]).float()
    return values, logprobs, ref, mask


@pytest.mark.parametrize("lam", [0.95, 1.0])
def test_dvpo_advantages_match_the_official_code(lam):
    values, logprobs, ref, mask = _right_padded()
    rewards = official_compute_rewards(logprobs, ref, 0.2)
    _, expected_adv, expected_ret = official_compute_advantages(values, rewards, mask, 1.0, lam)
    token_rewards, _ = outcome_token_rewards(torch.zeros(4), mask, old_log_probs=logprobs, ref_log_probs=ref,
                                             kl_coef=0.2, kl_kind="kl")
    advantages, returns = token_gae(token_rewards, values * mask, mask, gamma=1.0, lam=lam)
    torch.testing.assert_close(masked_whiten(advantages, mask), expected_adv * mask)
    torch.testing.assert_close(returns * mask, expected_ret * mask)


def test_value_targets_match_the_official_vas_trainer():
    values, _, _, mask = _right_padded(1)
    scores = torch.tensor([1.0, -1.0, 1.0, -1.0])
    official_rewards = torch.zeros_like(values)
    for i, length in enumerate(mask.sum(-1).long().tolist()):  # the score at the last response token
        official_rewards[i, length - 1] = scores[i]
    _, _, expected = official_compute_advantages(values, official_rewards, mask, 1.0, 0.95)
    module = GlobalValueModule.__new__(GlobalValueModule)  # the target computation alone, without a model
    torch.nn.Module.__init__(module)
    module._hparams = type("H", (), {"gamma": 1.0, "lam": 0.95})()
    targets = GlobalValueModule.value_targets.__get__(module)(scores, values, mask)
    torch.testing.assert_close(targets, expected * mask)


def test_value_targets_hand_values():
    module = GlobalValueModule.__new__(GlobalValueModule)
    torch.nn.Module.__init__(module)
    module._hparams = type("H", (), {"gamma": 1.0, "lam": 0.95})()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # V_old = 0: only the last token's TD error is the reward; G_t = lam^(L-1-t) x r
    targets = GlobalValueModule.value_targets.__get__(module)(torch.tensor([1.0, -1.0]), torch.zeros(2, 3), mask)
    torch.testing.assert_close(targets, torch.tensor([[0.9025, 0.95, 1.0], [-1.0, 0.0, 0.0]]))


def test_dvpo_needs_a_pretrained_value_model(tmp_path):
    with pytest.raises(ValueError, match="needs a pretrained value model"):
        DVPOModule(str(tmp_path), critic=ValueModelConfig(path=str(tmp_path)))


def _rows(log_dir: Path) -> list[dict[str, str]]:
    (path,) = log_dir.glob("**/metrics.csv")
    return list(csv.DictReader(path.open()))


def test_dvpo_configs_pretrain_then_train_against_the_frozen_value_model(tmp_path):
    texts = [SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)]
    tiny = build_tiny_vlm(tmp_path / "tiny", corpus=texts, vocab_size=400, hidden_size=64, intermediate_size=128)
    value_run = tmp_path / "value"
    args = tiny_grpo_fit_args(REPO / "configs" / "vlm" / "dvpo_value_tiny.yaml", str(tiny), value_run,
                              "--trainer.callbacks.init_args.every_n_train_steps=2", "--model.init_args.value_epochs=1")
    # the value model samples nothing: no sampling settings
    assert main([a for a in args if ".sampling." not in a]) == 0
    value_dir = value_run / "hf"
    head = torch.load(value_dir / VALUE_HEAD_FILE, weights_only=True)
    assert float(head["bias"].abs()) > 0  # trained from its zero initialisation
    rows = _rows(value_run)
    assert len([r for r in rows if r.get("losses/value")]) == 2
    # the targets are +1 / -1 at the last token: the first step's loss is 0.5 x mean(G^2) with V = 0, positive
    assert float(rows[0]["losses/value"]) > 0

    run = tmp_path / "dvpo"
    assert main(tiny_grpo_fit_args(REPO / "configs" / "vlm" / "dvpo_tiny.yaml", str(tiny), run,
                                   "--trainer.callbacks.init_args.every_n_train_steps=2",
                                   f"--model.init_args.critic.path={value_dir}")) == 0
    out = run / "hf"
    assert not (out / "critic").exists()  # the frozen value model is not exported again
    ckpt = torch.load(run / "ckpt" / "last.ckpt", weights_only=True, map_location="cpu")
    assert torch.equal(ckpt["state_dict"]["value_model.head.bias"], head["bias"])  # frozen
    assert torch.equal(ckpt["state_dict"]["value_model.head.weight"], head["weight"])
    assert len(ckpt["optimizer_states"][0]["param_groups"]) == 1  # no critic group
    logged = {k for r in _rows(run) for k, v in r.items() if v}
    assert {"ppo/kl_in_reward", "critic/values_mean", "losses/policy", "rewards/total/mean"} <= logged
    assert "losses/value" not in logged
