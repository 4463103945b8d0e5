"""DR-PO on GRPO: prefix lengths, prompts with the reset prefix appended, reset rollouts (texts and
log-probs condition on the prefix), the KL-in-reward penalty by hand, and a 2-step `mmpo fit`."""

from __future__ import annotations

import pytest
import torch

from mmpo.algos.drpo import DRPOModule, append_prefixes, preferred_response, reset_prefix_lengths
from mmpo.data import SYSTEM_PROMPT, render_solution
from mmpo.data.preference import synthetic_preference_row
from mmpo.data.synthetic import corpus, make_items
from mmpo.training.config import LossConfig, RewardConfig, RolloutCorrectionConfig, SamplingConfig
from mmpo.vlm.factory import build_tiny_vlm
from mmpo.vlm.logprobs import completion_log_probs


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    texts = [SYSTEM_PROMPT, *corpus(["arithmetic"], n=20)]
    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=texts, vocab_size=400, hidden_size=64,
                              intermediate_size=128))


def test_prefix_lengths_and_preferred_response():
    generator = torch.Generator().manual_seed(0)
    draws = [reset_prefix_lengths([5, 1, 2], generator) for _ in range(200)]
    assert {d[0] for d in draws} == {1, 2, 3, 4}  # 1..L-1: never the empty or the whole response
    assert {d[1] for d in draws} == {0} and {d[2] for d in draws} == {1}
    row = make_items("arithmetic", 1, seed=0)[0]
    assert preferred_response(row) == render_solution(row)
    assert preferred_response({**row, "chosen": "mine"}) == "mine"
    with pytest.raises(ValueError, match="neither 'chosen' nor an answer"):
        preferred_response({"id": "x", "problem": "p"})


def test_append_prefixes_re_left_pads():
    prompts = {"input_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]), "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
               "mm_token_type_ids": torch.tensor([[0, 1, 0], [0, 0, 0]])}
    out = append_prefixes(prompts, [[3, 4], [2]], pad_token_id=0)
    # row 0: [5, 6] + [3, 4] -> 4 tokens; row 1: [7, 8, 9] + [2] -> 4 tokens: no padding left
    assert out["input_ids"].tolist() == [[5, 6, 3, 4], [7, 8, 9, 2]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert out["mm_token_type_ids"].tolist() == [[1, 0, 0, 0], [0, 0, 0, 0]]
    out = append_prefixes(prompts, [[3, 4, 1], []], pad_token_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 3, 4, 1], [0, 0, 7, 8, 9]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]


def test_reset_rollout_continues_the_preferred_prefix(tiny_path):
    module = DRPOModule(tiny_path, reset_prob=1.0, kl_reward_coef=0.0,
                        sampling=SamplingConfig(num_generations=2, max_new_tokens=4))
    rows = [synthetic_preference_row(r, seed=0) for r in make_items("arithmetic", 2, seed=0)]
    torch.manual_seed(0)
    rollout = module.build_rollout(rows)
    assert module.reset_fraction == 1.0 and len(rollout) == 4
    tokenizer = module.processor.tokenizer
    for i, text in enumerate(rollout.texts):
        chosen = rows[int(rollout.group_ids[i])]["chosen"]
        prompt = rollout.prompt_inputs["input_ids"][i][rollout.prompt_inputs["attention_mask"][i].bool()].tolist()
        chosen_ids = tokenizer(chosen, add_special_tokens=False)["input_ids"]
        # the prompt ends with the first h tokens of the chosen response, and the text starts with them
        h = next(n for n in range(len(chosen_ids) - 1, 0, -1) if prompt[-n:] == chosen_ids[:n])
        assert text.startswith(tokenizer.decode(chosen_ids[:h], skip_special_tokens=True))
    # the same samples give the same rollout (the draws follow the seeded global RNG)
    torch.manual_seed(0)
    again = module.build_rollout(rows)
    assert again.texts == rollout.texts


def test_a_batch_of_reset_and_fresh_groups_concatenates(tiny_path):
    # seed 0 draws torch.rand(4) = [0.496, 0.768, 0.089, 0.132]: with reset_prob 0.5 rows 0, 2, 3 continue a
    # prefix and row 1 starts at the prompt; DR-PO used to fail here (the reset part carried no extras)
    from mmpo.vlm.processing import encode_prompts

    module = DRPOModule(tiny_path, reset_prob=0.5, kl_reward_coef=0.0,
                        sampling=SamplingConfig(num_generations=2, max_new_tokens=4))
    rows = [synthetic_preference_row(r, seed=0) for r in make_items("arithmetic", 4, seed=0)]
    torch.manual_seed(0)
    rollout = module.build_rollout(rows)
    assert module.reset_fraction == 0.75 and len(rollout) == 8
    assert rollout.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    order = [1, 0, 2, 3]  # the fresh part, then the reset part
    assert [row["id"] for row in rollout.rows[::2]] == [rows[i]["id"] for i in order]
    assert rollout.extras["vision_cut"].tolist() == [False] * 8
    plain = encode_prompts(module.processor, rows, system_prompt=module.engine.system_prompt)
    plain_lengths = plain["attention_mask"].sum(-1).tolist()
    lengths = rollout.prompt_inputs["attention_mask"].sum(-1).tolist()[::2]
    assert lengths[0] == plain_lengths[1]  # fresh: the prompt alone
    assert all(lengths[k] > plain_lengths[i] for k, i in enumerate(order) if k > 0)  # reset: prompt + prefix
    rewards, metrics = module.compute_rewards(rollout)
    assert rewards.shape == (8,) and metrics["reset/fraction"] == 0.75


def test_kl_penalty_in_the_reward(tiny_path, scripted_reward):
    weights = scripted_reward([1.0, 0.0])
    module = DRPOModule(tiny_path, reset_prob=0.0, kl_reward_coef=0.5,
                        sampling=SamplingConfig(num_generations=2, max_new_tokens=4),
                        rewards=RewardConfig(weights=weights, timeout_s=None),
                        loss={"beta": 0.0})
    torch.manual_seed(0)
    rollout = module.build_rollout(make_items("arithmetic", 2, seed=0))
    total, metrics = module.compute_rewards(rollout)
    assert total.tolist() == [1.0, 0.0, 1.0, 0.0]  # policy == pi_ref: no penalty
    assert metrics["rewards/kl_penalty/mean"] == 0.0 and metrics["reset/fraction"] == 0.0
    with torch.no_grad():
        for p in module.model.parameters():
            p.mul_(1.05)
    total, _ = module.compute_rewards(rollout)
    mask = rollout.completion_mask.float()
    policy = completion_log_probs(module.model, rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask)[0]
    ref = completion_log_probs(module.reference_model, rollout.prompt_inputs, rollout.completion_ids,
                               rollout.completion_mask)[0]
    expected = torch.tensor([1.0, 0.0, 1.0, 0.0]) - 0.5 * ((policy - ref) * mask).sum(-1)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(total, torch.tensor([1.0, 0.0, 1.0, 0.0]))


def test_config_errors(tiny_path):
    with pytest.raises(ValueError, match=r"reset_prob must be in \[0, 1\]"):
        DRPOModule(tiny_path, reset_prob=1.5)
    with pytest.raises(ValueError, match="set rollout_is null"):
        DRPOModule(tiny_path, rollout_correction=RolloutCorrectionConfig(mode="token_truncate"))


def test_drpo_tiny_config_fits_two_steps(tiny_path, tmp_path, fit_vlm_config):
    rows = fit_vlm_config("drpo_tiny.yaml", tiny_path, tmp_path, "--model.init_args.reset_prob=1.0",
                          "--model.init_args.sampling.num_generations=2", "--model.init_args.sampling.val_max_new_tokens=4",
                          "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false", "--data.init_args.batch_size=4")
    steps = [r for r in rows if r.get("losses/policy")]
    assert len(steps) == 2
    assert [float(r["reset/fraction"]) for r in steps] == [1.0, 1.0]
    assert float(steps[0]["rewards/kl_penalty/mean"]) == pytest.approx(0.0, abs=1e-6)  # step 1: pi_old == pi_ref


def test_drpo_tiny_config_fits_two_steps_mixing_reset_and_fresh_groups(tiny_path, tmp_path, fit_vlm_config):
    # reset_prob 0.5 on 4 prompts: under seed 0 each step's batch mixes reset and fresh groups
    rows = fit_vlm_config("drpo_tiny.yaml", tiny_path, tmp_path, "--model.init_args.reset_prob=0.5",
                          "--model.init_args.sampling.num_generations=2", "--model.init_args.sampling.val_max_new_tokens=4",
                          "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false", "--data.init_args.batch_size=4")
    steps = [r for r in rows if r.get("losses/policy")]
    assert len(steps) == 2
    fractions = [float(r["reset/fraction"]) for r in steps]
    assert all(0.0 < f < 1.0 for f in fractions), fractions
    assert all(float(r["response/vision_cut_frac"]) == 0.0 for r in steps)
