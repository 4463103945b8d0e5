"""DiffuGRPO's ``advantage`` / ``loss`` / ``kl_kind`` settings: the core's verl / TRL names reach the dLLM loss.

Rollouts are scripted (known texts, so known rewards); ``igpo_loss`` is wrapped to record what reaches it.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import dllm.rl as rl
from dllm.hints import HintConfig
from dllm.modeling import save_mask_predictor
from dllm.rewards import derivation_format_reward
from dllm.rollout import Rollout
from dllm.sampler import SamplerConfig
from mmpo.core import compute_advantages, kl_penalty

GEN = 8
ROWS = [{"problem": "1+2", "trace": "1+2=3\nA:3", "answer": "3"}, {"problem": "2*2", "trace": "2*2=4\nA:4", "answer": "4"}]
PLAIN = ["1+2=3\nA:3", "1+2=4\nA:4", "1+2=5", "2*2=4\nA:4", "2*2=4\nA:4", "A:7"]  # 3 per group, G = 3
GREEDY = ["1+2=3\nA:3", "2*2=5\nA:5"]  # temperature-0 rollouts: prompt 0 right, prompt 1 wrong
CORRECT = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
REWARDS = [c + derivation_format_reward(t) for c, t in zip(CORRECT, PLAIN)]
GROUP_IDS = torch.tensor([0, 0, 0, 1, 1, 1])


@pytest.fixture
def start(tiny_model_and_tokenizer, tmp_path):
    model, tokenizer = tiny_model_and_tokenizer
    save_mask_predictor(model, tokenizer, tmp_path / "start")
    return str(tmp_path / "start")


@pytest.fixture
def scripted(monkeypatch):
    """Scripted rollouts (greedy ones recognised by temperature 0) and a recorder of igpo_loss's inputs."""
    calls: list[dict] = []

    def fake_rollout(model, tokenizer, problems, config, *, fixed_tokens=None, fixed_mask=None, generator=None):
        texts = GREEDY if config.temperature == 0 else PLAIN
        assert len(texts) == len(problems)
        n = len(problems)
        completions = torch.arange(n * GEN).reshape(n, GEN) % 7
        return Rollout(torch.ones(n, 3, dtype=torch.long), torch.ones(n, 3, dtype=torch.long), completions,
                       torch.zeros(n, GEN, dtype=torch.bool), list(texts))

    original = rl.igpo_loss

    def recording_loss(log_probs, old_log_probs, ref_log_probs, advantages, loss_mask, **kwargs):
        loss, metrics = original(log_probs, old_log_probs, ref_log_probs, advantages, loss_mask, **kwargs)
        calls.append(dict(log_probs=log_probs.detach().clone(), old=old_log_probs.clone(),
                          ref=None if ref_log_probs is None else ref_log_probs.clone(), advantages=advantages.clone(),
                          mask=loss_mask.clone(), value=loss.detach().clone(), metrics=metrics, **kwargs))
        return loss, metrics

    monkeypatch.setattr(rl, "rollout", fake_rollout)
    monkeypatch.setattr(rl, "igpo_loss", recording_loss)
    return calls


def _module(start, tmp_path, **overrides) -> rl.DiffuGRPO:
    settings = dict(model_path=start, warmup_config=None, save_dir=str(tmp_path / "out"), group_size=3,
                    inner_updates=2, igpo=False, beta=0.0, format_reward="derivation", reward_timeout_s=None,
                    lr=1e-2, warmup_steps=0, max_grad_norm=1e9, overwrite_output=True,
                    sampler=SamplerConfig(gen_length=GEN, block_length=8, steps=4),
                    hints=HintConfig(min_chunk=1, max_chunk=2, free_tail=1))
    return rl.DiffuGRPO(**{**settings, **overrides})


def _step(module: rl.DiffuGRPO) -> dict[str, torch.Tensor]:
    """One training step (inner_updates optimizer steps); the weights after it."""
    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=module.settings["inner_updates"], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(module, DataLoader([ROWS], batch_size=None, collate_fn=lambda x: x))
    return {name: p.detach().clone() for name, p in module.model.named_parameters()}


def test_explicit_default_names_equal_the_default_step(start, tmp_path, scripted):
    default = _step(_module(start, tmp_path, beta=0.01))
    explicit = _step(_module(start, tmp_path, beta=0.01, advantage="drgrpo", loss="igpo_sequence", kl_kind="k3"))
    alias = _step(_module(start, tmp_path, beta=0.01, kl_kind="low_var_kl"))  # verl's name of k3, same clamps
    for name, weight in default.items():
        assert torch.equal(weight, explicit[name]), name
        assert torch.equal(weight, alias[name]), name
    rewards = torch.tensor(REWARDS)
    assert scripted[0]["advantages"].tolist() == pytest.approx(
        (rewards - rewards.view(2, 3).mean(1).repeat_interleave(3)).tolist())
    other = _step(_module(start, tmp_path, beta=0.01, loss="ppo"))  # a different loss: the comparison sees it
    assert any(not torch.equal(weight, other[name]) for name, weight in default.items())


@pytest.mark.parametrize("name", ["reinforce_plus_plus_baseline", "grpo_passk", "opo", "gpg", "reinforce_plus_plus",
                                  "grpo", "rloo", "hapo"])
def test_estimator_advantages_reach_the_loss(start, tmp_path, scripted, name):
    _step(_module(start, tmp_path, advantage=name))
    rewards = torch.tensor(REWARDS)
    mask = torch.ones(6, GEN)  # the dLLM completion mask: every generated position
    settings = {"mask": mask} if name in {"reinforce_plus_plus_baseline", "opo", "reinforce_plus_plus", "hapo"} else {}
    expected = compute_advantages(name, rewards, GROUP_IDS, **settings)
    assert len(scripted) == 2
    for call in scripted:  # both inner updates get the batch's advantages
        assert call["advantages"].shape == expected.shape
        assert torch.allclose(call["advantages"], expected, atol=1e-6)


def test_estimator_values_by_hand(start, tmp_path, scripted):
    rewards = torch.tensor(REWARDS)
    _step(_module(start, tmp_path, advantage="grpo_passk", inner_updates=1))
    passk = scripted[-1]["advantages"]
    # group 1: rewards (1.75, 1.75, f("A:7")): a tie at the top gives the whole group 0
    assert passk[3:].tolist() == [0.0, 0.0, 0.0]
    g0 = rewards[:3]
    top2 = g0.sort(descending=True).values[:2]
    assert passk[0] == pytest.approx(float((top2[0] - top2[1]) / (g0.std() + 1e-6)))
    assert passk[1:3].tolist() == [0.0, 0.0]
    _step(_module(start, tmp_path, advantage="opo", inner_updates=1))
    # every completion covers all GEN positions: OPO's length-weighted baseline is the group mean (= drgrpo)
    drgrpo = rewards - rewards.view(2, 3).mean(1).repeat_interleave(3)
    assert scripted[-1]["advantages"].tolist() == pytest.approx(drgrpo.tolist())
    _step(_module(start, tmp_path, advantage="reinforce_plus_plus_baseline", inner_updates=1))
    token_adv = scripted[-1]["advantages"]
    centred = rewards - rewards.view(2, 3).mean(1).repeat_interleave(3)
    n = 6 * GEN  # whitening over every token: each row has GEN equal ones; Bessel over 6 x GEN values
    whitened = (centred - centred.mean()) / torch.sqrt(centred.var(unbiased=False) * n / (n - 1) + 1e-8)
    assert token_adv.shape == (6, GEN)
    assert torch.allclose(token_adv, whitened.unsqueeze(1).expand(6, GEN), atol=1e-5)


def test_remax_baseline_is_the_greedy_rollouts_reward(start, tmp_path, scripted):
    module = _module(start, tmp_path, advantage="remax", inner_updates=1)
    _step(module)
    baselines = [1.0 + derivation_format_reward(GREEDY[0])] * 3 + [derivation_format_reward(GREEDY[1])] * 3
    expected = torch.tensor(REWARDS) - torch.tensor(baselines)
    assert torch.allclose(scripted[-1]["advantages"], expected, atol=1e-6)


def test_sapo_loss_at_ratio_one_is_two_over_tau_times_advantage(start, tmp_path, scripted):
    _step(_module(start, tmp_path, loss="sapo", loss_settings={"tau_pos": 1.0, "tau_neg": 2.0}))
    first = scripted[0]
    assert first["loss"] == "sapo" and torch.equal(first["log_probs"], first["old"])  # on-policy: r = 1
    adv = first["advantages"]
    tau = torch.where(adv > 0, 1.0, 2.0)
    # SAPO's gate at r = 1 is 4/tau * sigmoid(0) = 2/tau; token-mean over equal-length rows
    assert float(first["value"]) == pytest.approx(float((-2.0 / tau * adv).mean()), abs=1e-6)


def test_gpg_loss_is_minus_advantage_times_log_prob(start, tmp_path, scripted):
    _step(_module(start, tmp_path, loss="gpg", advantage="gpg"))
    for call in scripted:
        expected = -(call["advantages"].unsqueeze(1) * call["log_probs"]).mean()
        assert float(call["value"]) == pytest.approx(float(expected), rel=1e-6, abs=1e-7)
    nonzero = sum(r != 0 for r in REWARDS)
    assert scripted[0]["metrics"]["policy/clipfrac"] == 0.0 and nonzero == 6  # GPG's alpha = 6 / 6


@pytest.mark.parametrize("kind", ["abs", "low_var_kl", "mse"])
def test_kl_kind_reaches_the_kl_term(start, tmp_path, scripted, kind):
    _step(_module(start, tmp_path, beta=0.5, kl_kind=kind))
    second = scripted[1]  # after one optimizer step the policy has left the reference
    gap = second["log_probs"] - second["ref"]
    assert float(gap.abs().max()) > 1e-4
    expected = {"abs": gap.abs(), "mse": 0.5 * gap.square(), "low_var_kl": torch.exp(-gap) + gap - 1.0}[kind]
    assert float(second["metrics"]["losses/kl"]) == pytest.approx(float(expected.mean()), rel=1e-5)
    assert torch.allclose(expected, kl_penalty(second["log_probs"], second["ref"], kind))


def test_bad_names_fail_at_construction_naming_the_valid_ones(start, tmp_path):
    with pytest.raises(ValueError, match=r"unknown advantage 'nope'.*reinforce_plus_plus_baseline"):
        _module(start, tmp_path, advantage="nope")
    with pytest.raises(ValueError, match=r"unknown loss 'nope'.*sapo"):
        _module(start, tmp_path, loss="nope")
    with pytest.raises(ValueError, match=r"unknown kl_kind 'nope'.*low_var_kl"):
        _module(start, tmp_path, kl_kind="nope")
    with pytest.raises(ValueError, match=r"ratio_level 'token' selects loss 'ppo' but loss is 'sapo'"):
        _module(start, tmp_path, ratio_level="token", loss="sapo")
    with pytest.raises(ValueError, match=r"loss 'sapo' has no clip bounds: \{'clip_high': 0.3\}"):
        _module(start, tmp_path, loss="sapo", clip_high=0.3)
    with pytest.raises(ValueError, match="tau_pos"):  # the loss's own settings are checked too
        _module(start, tmp_path, loss="sapo", loss_settings={"tau_pos": -1.0})
    with pytest.raises(ValueError, match="gamma_typo"):
        _module(start, tmp_path, advantage="reinforce_plus_plus", advantage_settings={"gamma_typo": 0.9})
    with pytest.raises(ValueError, match="provided by the module"):
        _module(start, tmp_path, advantage="opo", advantage_settings={"mask": None})


def test_ratio_level_and_loss_that_agree_are_accepted(start, tmp_path):
    assert rl.check_loss_choice("token", "ppo", None, 0.2, 0.2, "k3", "token-mean") == "ppo"
    assert rl.check_loss_choice("sequence", "cispo", None, 0.2, 0.2, "k3", "token-mean") == "cispo"
    assert rl.check_loss_choice("sequence_masked", None, None, 0.2, 0.2, "k3", "token-mean") == "gspo"
    module = _module(start, tmp_path, ratio_level="sequence_masked", loss="gspo")
    assert module.settings["loss"] == "gspo"


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_estimators_needing_token_statistics_fail_clearly(start, tmp_path, name):
    with pytest.raises(ValueError, match=rf"advantage '{name}' needs the input\(s\) \['old_log_probs', "
                                         r"'sum_pi_squared'\], which the dLLM module does not compute"):
        _module(start, tmp_path, advantage=name)


def test_config_override_trains_two_steps_through_mmpo_fit(start, tmp_path, monkeypatch):
    """``mmpo fit -c configs/dllm/grpo_tiny.yaml --model.init_args.advantage=opo`` (+ loss / kl_kind) on a tiny model."""
    import csv
    from pathlib import Path

    from mmpo.cli import main

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    out = tmp_path / "run"
    main([
        "fit", "-c", str(repo / "configs/dllm/grpo_tiny.yaml"), f"--model.init_args.model_path={start}",
        "--model.init_args.warmup_config=null", f"--model.init_args.save_dir={out / 'model'}",
        f"--trainer.default_root_dir={out}", f"--trainer.callbacks.init_args.dirpath={out / 'ckpt'}",
        "--model.init_args.advantage=opo", "--model.init_args.loss=sapo", "--model.init_args.kl_kind=low_var_kl",
        "--model.init_args.loss_settings={tau_pos: 1.0, tau_neg: 1.2}",
        "--model.init_args.group_size=2", "--model.init_args.sampler.gen_length=8", "--model.init_args.sampler.steps=4",
        "--trainer.max_steps=2", "--trainer.enable_progress_bar=false", "--model.init_args.reward_timeout_s=null",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.init_args.save_dir={out}",
        "--data.init_args.batch_size=2", "--data.init_args.train_size=8", "--data.init_args.test_size=4",
        "--data.init_args.val_size=2",
    ])
    with open(sorted(out.rglob("metrics.csv"))[-1]) as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("losses/policy")]
    assert len(rows) == 1  # 2 optimizer steps = 1 batch x inner_updates 2
    assert torch.isfinite(torch.tensor(float(rows[0]["losses/policy"])))
    hparams = (sorted(out.rglob("hparams.yaml"))[-1]).read_text()
    assert "advantage: opo" in hparams and "loss: sapo" in hparams and "kl_kind: low_var_kl" in hparams
    assert "tau_neg: 1.2" in hparams


def test_remax_greedy_rollout_leaves_the_sampled_rollouts_unchanged(start, tmp_path):
    """Real sampler: the greedy baseline rollout (after the sampled ones, on its own generator) does not change
    what ``advantage: remax`` samples, and its baseline is one value per prompt's group."""
    plain = _module(start, tmp_path, reward_timeout_s=None).collect(ROWS)
    remax = _module(start, tmp_path, advantage="remax", reward_timeout_s=None).collect(ROWS)
    assert torch.equal(plain["completions"], remax["completions"])
    assert torch.equal(plain["rewards"], remax["rewards"])
    assert "reward_baselines" not in plain
    baselines = remax["reward_baselines"]
    assert baselines.shape == (6,) and torch.equal(baselines, baselines[::3].repeat_interleave(3))


# ---------------------------------------------------------------------- LSPO and SFPO on the dLLM module (dllm/variants.py)


def test_lspo_keeps_the_short_band(start, tmp_path, scripted, monkeypatch):
    from dllm.variants import LSPODiffuGRPO, completion_lengths

    module = LSPODiffuGRPO(**_settings(start, tmp_path, inner_updates=1))
    eos = module.tokenizer.eos_token_id
    filler = (eos + 1) % len(module.tokenizer)
    completions = torch.full((6, GEN), filler)
    completions[:3, 2] = eos  # prompt 0's completions: 2 tokens; prompt 1's: no EOS, all GEN = 8
    original = rl.rollout

    def with_lengths(*args, **kwargs):
        out = original(*args, **kwargs)
        return Rollout(out.prompt_ids, out.prompt_attention_mask, completions.clone(), out.fixed_mask, out.texts)

    monkeypatch.setattr(rl, "rollout", with_lengths)
    assert completion_lengths(completions, eos).tolist() == [2.0] * 3 + [8.0] * 3
    _step(module)
    # both groups vary (REWARDS), so both are candidates: L = [2, 8], Q(0.3) = 3.8, Q(0.65) = 5.9, Q(0.95) = 7.7
    # -> prompt 0 (2 <= 3.8) stays, prompt 1 (8 > Q(0.95)) leaves the loss
    mask = scripted[0]["mask"]
    assert bool(mask[:3].any()) and not bool(mask[3:].any())


def test_sfpo_k1_alpha1_is_two_plain_steps(start, tmp_path, scripted):
    from dllm.variants import SFPODiffuGRPO

    # K = 1, alpha = 1, one inner update per pass: fast step, reposition onto it, slow step = 2 plain steps
    sfpo = _step(SFPODiffuGRPO(**_settings(start, tmp_path, inner_updates=1, beta=0.01), sfpo_inner_steps=1,
                               sfpo_alpha=1.0))
    plain = _step(_module(start, tmp_path, inner_updates=2, beta=0.01))
    half = _step(SFPODiffuGRPO(**_settings(start, tmp_path, inner_updates=1, beta=0.01), sfpo_inner_steps=1,
                               sfpo_alpha=0.5))
    for name, weight in plain.items():
        assert torch.equal(sfpo[name], weight), name
    assert any(not torch.equal(half[name], weight) for name, weight in plain.items())
    assert all(call["old"].equal(scripted[0]["old"]) for call in scripted)  # pi_old stays theta_0's


def _settings(start, tmp_path, **overrides) -> dict:
    settings = dict(model_path=start, warmup_config=None, save_dir=str(tmp_path / "out"), group_size=3,
                    inner_updates=2, igpo=False, beta=0.0, format_reward="derivation", reward_timeout_s=None,
                    lr=1e-2, warmup_steps=0, max_grad_norm=1e9, overwrite_output=True,
                    sampler=SamplerConfig(gen_length=GEN, block_length=8, steps=4),
                    hints=HintConfig(min_chunk=1, max_chunk=2, free_tail=1))
    return {**settings, **overrides}
