"""DVPO (mmpo.algos.dvpo): TRL's adaptive KL controller by hand and against TRL's code, the value model's
pretraining loss by hand, the export read back as the critic, DVPO's advantages (GAE over the whitened frozen values
with KL-only token rewards), the frozen critic, and both configs through `mmpo fit`."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tiny_vlm_support import tiny_grpo_fit_args

from mmpo.algos.dvpo import DVPOModule, ValuePretrainModule, adaptive_kl_coef
from mmpo.algos.ppo import ValueModel, ValueModelConfig
from mmpo.cli import main
from mmpo.core import rlhf_token_rewards, token_gae
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.preference import synthetic_preference_row
from mmpo.data.synthetic import corpus, make_items
from mmpo.training.config import OptimConfig, SamplingConfig
from mmpo.vlm.factory import build_tiny_vlm

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class TRLAdaptiveKLController:
    """trl/trainer/utils.py (TRL 0.x) ``AdaptiveKLController``, transcribed."""

    def __init__(self, init_kl_coef, target, horizon):
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current, n_steps):
        target = self.target
        proportional_error = torch.clip(torch.tensor(current / target - 1), -0.2, 0.2).item()
        mult = 1 + proportional_error * n_steps / self.horizon
        self.value *= mult


def test_adaptive_kl_coef_by_hand_and_like_trl():
    # KL 9 vs target 6: error 0.5 clipped to 0.2 -> x (1 + 0.2 x 8 / 10000); KL 5.4: error -0.1
    assert adaptive_kl_coef(0.2, 9.0, 6.0, 10000, 8) == pytest.approx(0.2 * (1 + 0.2 * 8 / 10000))
    assert adaptive_kl_coef(0.2, 5.4, 6.0, 10000, 8) == pytest.approx(0.2 * (1 - 0.1 * 8 / 10000))
    trl = TRLAdaptiveKLController(0.2, 6.0, 10000)
    ours = 0.2
    for kl, n in ((9.0, 8), (1.0, 16), (6.5, 8), (0.0, 4)):
        trl.update(kl, n)
        ours = adaptive_kl_coef(ours, kl, 6.0, 10000, n)
        assert ours == pytest.approx(trl.value, rel=1e-6)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    texts = [SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)]
    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=texts, vocab_size=400, hidden_size=64,
                              intermediate_size=128))


def test_value_pretraining_loss_by_hand(tiny_path):
    """A zero head: V = 0 everywhere, so with gamma 1, lam 0.95 the return of token t of a response of L tokens is
    +-0.95^(L-1-t) and the loss is 0.5 x the token mean of its square."""
    module = ValuePretrainModule(tiny_path, optim=OptimConfig(lr=1e-3))
    rows = [synthetic_preference_row(row, 0) for row in make_items("arithmetic", 2, seed=0)]
    batch, outcome = module.pairs(rows)
    assert outcome.tolist() == [1.0, 1.0, -1.0, -1.0]
    lengths = batch.completion_mask.sum(-1).tolist()
    squares = [0.95 ** (2 * (length - 1 - t)) for length in lengths for t in range(length)]
    loss, metrics = module.value_loss(rows)
    assert float(loss) == pytest.approx(0.5 * sum(squares) / sum(lengths), rel=1e-5)
    assert metrics["value/final_accuracy"] == 0.0  # V = 0: no final value is on its side of 0 (> 0 chosen, < 0 rejected)


def test_dvpo_advantages_and_a_frozen_critic(tiny_path, tmp_path):
    value_dir = tmp_path / "value"
    pretrain = ValuePretrainModule(tiny_path, output_dir=str(value_dir))
    with torch.no_grad():
        pretrain.value_model.head.weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(0))
        pretrain.value_model.head.bias.fill_(0.1)
    pretrain.save_hf()
    assert torch.equal(load_file(str(value_dir / ValueModel.HEAD_FILE))["bias"], torch.tensor([0.1]))
    module = DVPOModule(tiny_path, sampling=SamplingConfig(num_generations=2, max_new_tokens=5),
                        optim=OptimConfig(lr=1e-3), critic=ValueModelConfig(model_path=str(value_dir), lam=0.95))
    torch.testing.assert_close(module.critic.head.weight, pretrain.value_model.head.weight)
    assert not any(p.requires_grad for p in module.critic.parameters())
    torch.manual_seed(0)
    rollout = module.build_rollout(make_items("arithmetic", 2, seed=0))
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])  # ignored by DVPO
    advantages, metrics = module.compute_advantages(rewards, rollout.group_ids, rollout)
    mask = rollout.completion_mask.float()
    with torch.no_grad():
        values = module.critic(rollout)
        log_probs = module._log_probs_no_grad(module.model, rollout, 4)
        ref = module._log_probs_no_grad(module.reference_model, rollout, 4)
    whitened = (values - values.mean()) / torch.sqrt(values.var() + 1e-8) * mask
    token_rewards = rlhf_token_rewards(torch.zeros(4), mask, log_probs=log_probs, ref_log_probs=ref, kl_coef=0.2)
    expected, _ = token_gae(token_rewards, whitened, mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)
    assert metrics["dvpo/kl_coef"] == 0.2 and rollout.extras["dvpo_kl"] == pytest.approx(0.0, abs=1e-6)


def _rows_with(path: Path, key: str) -> list[dict[str, str]]:
    (metrics,) = path.glob("**/metrics.csv")
    return [row for row in csv.DictReader(metrics.open()) if row.get(key)]


def test_dvpo_configs_train_through_mmpo_fit(tiny_path, tmp_path):
    stage1 = tmp_path / "stage1"
    args = tiny_grpo_fit_args(CONFIGS / "vlm" / "dvpo_value_tiny.yaml", tiny_path, stage1)
    args = [a for a in args if "sampling" not in a]  # stage 1 samples nothing
    assert main(args) == 0
    assert (stage1 / "hf" / ValueModel.HEAD_FILE).is_file()
    assert len(_rows_with(stage1, "losses/value")) == 2
    stage2 = tmp_path / "stage2"
    assert main(tiny_grpo_fit_args(CONFIGS / "vlm" / "dvpo_tiny.yaml", tiny_path, stage2,
                                   f"--model.init_args.critic.model_path={stage1 / 'hf'}")) == 0
    rows = _rows_with(stage2, "dvpo/kl_coef")
    assert len(rows) == 2 and float(rows[0]["dvpo/kl_coef"]) == pytest.approx(0.2)
    # step 1's KL is 0 (policy = reference): the adaptive coefficient shrinks by 1 - 0.2 x 4 / 10000
    assert float(rows[1]["dvpo/kl_coef"]) == pytest.approx(0.2 * (1 - 0.2 * 4 / 10000), rel=1e-6)
    checkpoint = torch.load(stage2 / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    head = load_file(str(stage1 / "hf" / ValueModel.HEAD_FILE))
    torch.testing.assert_close(checkpoint["state_dict"]["critic.head.weight"], head["weight"])  # never trained
    assert all(math.isfinite(float(r["losses/policy"])) for r in rows)
