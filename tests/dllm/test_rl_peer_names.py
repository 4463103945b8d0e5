"""DiffuGRPO's ``advantage.name`` / ``loss.name`` / ``loss.kl_kind`` settings: the core's verl / TRL names reach the dLLM loss.

Rollouts are scripted (known texts, so known rewards); ``igpo_loss`` is wrapped to record what reaches it.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import mmpo.dllm.rl as rl
from mmpo.dllm.config import DLLM_GROUPS
from mmpo.dllm.hints import HintConfig
from mmpo.dllm.modeling import save_mask_predictor
from mmpo.dllm.rewards import derivation_format_reward
from mmpo.dllm.rollout import Rollout
from mmpo.dllm.sampler import SamplerConfig
from mmpo.core import compute_advantages, kl_penalty
from mmpo.training.config import merged_settings

GEN = 8
ROWS = [{"problem": "1+2", "trace": "1+2=3\nA:3", "answer": "3"}, {"problem": "2*2", "trace": "2*2=4\nA:4", "answer": "4"}]
PLAIN = ["1+2=3\nA:3", "1+2=4\nA:4", "1+2=5", "2*2=4\nA:4", "2*2=4\nA:4", "A:7"]  # 3 per group, G = 3
GREEDY = ["1+2=3\nA:3", "2*2=5\nA:5"]  # temperature-0 rollouts: prompt 0 right, prompt 1 wrong
CORRECT = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
REWARDS = [c + derivation_format_reward(t) for c, t in zip(CORRECT, PLAIN)]
GROUP_IDS = torch.tensor([0, 0, 0, 1, 1, 1])
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def start(tiny_model_and_tokenizer, tmp_path):
    model, tokenizer = tiny_model_and_tokenizer
    save_mask_predictor(model, tokenizer, tmp_path / "start")
    return str(tmp_path / "start")


@pytest.fixture
def scripted(monkeypatch):
    """Scripted rollouts (greedy ones recognised by temperature 0) and a recorder of igpo_loss_parts's inputs."""
    calls: list[dict] = []

    def fake_rollout(model, tokenizer, problems, config, *, fixed_tokens=None, fixed_mask=None, generator=None):
        texts = GREEDY if config.temperature == 0 else PLAIN
        assert len(texts) == len(problems)
        n = len(problems)
        completions = torch.arange(n * GEN).reshape(n, GEN) % 7
        return Rollout(torch.ones(n, 3, dtype=torch.long), torch.ones(n, 3, dtype=torch.long), completions,
                       torch.zeros(n, GEN, dtype=torch.bool), list(texts))

    original = rl.igpo_loss_parts

    def recording_loss(log_probs, old_log_probs, ref_log_probs, advantages, loss_mask, **kwargs):
        parts, metrics = original(log_probs, old_log_probs, ref_log_probs, advantages, loss_mask, **kwargs)
        calls.append(dict(log_probs=log_probs.detach().clone(), old=old_log_probs.clone(),
                          ref=None if ref_log_probs is None else ref_log_probs.clone(), advantages=advantages.clone(),
                          mask=loss_mask.clone(), value=parts.total().detach().clone(),
                          metrics={**metrics, **parts.metrics()}, **kwargs))
        return parts, metrics

    monkeypatch.setattr(rl, "rollout", fake_rollout)
    monkeypatch.setattr(rl, "igpo_loss_parts", recording_loss)
    return calls


def _module(start, tmp_path, **overrides) -> rl.DiffuGRPO:
    return rl.DiffuGRPO(**_settings(start, tmp_path, **overrides))


def _step(module: rl.DiffuGRPO, batches: int = 1) -> dict[str, torch.Tensor]:
    """``batches`` training steps (optim.mu optimizer steps each) on ROWS; the weights after them
    (the last step's logged metrics stay in ``module.trainer.callback_metrics``)."""
    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=batches * module.optim.mu,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader([ROWS] * batches, batch_size=None, collate_fn=lambda x: x))
    return {name: p.detach().clone() for name, p in module.model.named_parameters()}


def test_explicit_default_names_equal_the_default_step(start, tmp_path, scripted):
    default = _step(_module(start, tmp_path, loss={"beta": 0.01}))
    explicit = _step(_module(start, tmp_path, loss={"beta": 0.01, "name": "igpo_sequence", "kl_kind": "k3"},
                             advantage={"name": "drgrpo"}))
    alias = _step(_module(start, tmp_path, loss={"beta": 0.01, "kl_kind": "low_var_kl"}))  # verl's name of k3
    for name, weight in default.items():
        assert torch.equal(weight, explicit[name]), name
        assert torch.equal(weight, alias[name]), name
    rewards = torch.tensor(REWARDS)
    assert scripted[0]["advantages"].tolist() == pytest.approx(
        (rewards - rewards.view(2, 3).mean(1).repeat_interleave(3)).tolist())
    other = _step(_module(start, tmp_path, loss={"beta": 0.01, "name": "ppo"}))  # a different loss: the comparison sees it
    assert any(not torch.equal(weight, other[name]) for name, weight in default.items())


@pytest.mark.parametrize("name", ["reinforce_plus_plus_baseline", "grpo_passk", "opo", "gpg", "reinforce_plus_plus",
                                  "grpo", "rloo", "hapo"])
def test_estimator_advantages_reach_the_loss(start, tmp_path, scripted, name):
    _step(_module(start, tmp_path, advantage={"name": name}))
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
    _step(_module(start, tmp_path, advantage={"name": "grpo_passk"}, optim={"mu": 1}))
    passk = scripted[-1]["advantages"]
    # group 1: rewards (1.75, 1.75, f("A:7")): a tie at the top gives the whole group 0
    assert passk[3:].tolist() == [0.0, 0.0, 0.0]
    g0 = rewards[:3]
    top2 = g0.sort(descending=True).values[:2]
    assert passk[0] == pytest.approx(float((top2[0] - top2[1]) / (g0.std() + 1e-6)))
    assert passk[1:3].tolist() == [0.0, 0.0]
    _step(_module(start, tmp_path, advantage={"name": "opo"}, optim={"mu": 1}))
    # every completion covers all GEN positions: OPO's length-weighted baseline is the group mean (= drgrpo)
    drgrpo = rewards - rewards.view(2, 3).mean(1).repeat_interleave(3)
    assert scripted[-1]["advantages"].tolist() == pytest.approx(drgrpo.tolist())
    _step(_module(start, tmp_path, advantage={"name": "reinforce_plus_plus_baseline"}, optim={"mu": 1}))
    token_adv = scripted[-1]["advantages"]
    centred = rewards - rewards.view(2, 3).mean(1).repeat_interleave(3)
    n = 6 * GEN  # whitening over every token: each row has GEN equal ones; Bessel over 6 x GEN values
    whitened = (centred - centred.mean()) / torch.sqrt(centred.var(unbiased=False) * n / (n - 1) + 1e-8)
    assert token_adv.shape == (6, GEN)
    assert torch.allclose(token_adv, whitened.unsqueeze(1).expand(6, GEN), atol=1e-5)


def test_remax_baseline_is_the_greedy_rollouts_reward(start, tmp_path, scripted):
    module = _module(start, tmp_path, advantage={"name": "remax"}, optim={"mu": 1})
    _step(module)
    baselines = [1.0 + derivation_format_reward(GREEDY[0])] * 3 + [derivation_format_reward(GREEDY[1])] * 3
    expected = torch.tensor(REWARDS) - torch.tensor(baselines)
    assert torch.allclose(scripted[-1]["advantages"], expected, atol=1e-6)


def test_sapo_loss_at_ratio_one_is_two_over_tau_times_advantage(start, tmp_path, scripted):
    _step(_module(start, tmp_path, loss={"name": "sapo", "settings": {"tau_pos": 1.0, "tau_neg": 2.0}}))
    first = scripted[0]
    assert first["loss"] == "sapo" and torch.equal(first["log_probs"], first["old"])  # on-policy: r = 1
    adv = first["advantages"]
    tau = torch.where(adv > 0, 1.0, 2.0)
    # SAPO's gate at r = 1 is 4/tau * sigmoid(0) = 2/tau; token-mean over equal-length rows
    assert float(first["value"]) == pytest.approx(float((-2.0 / tau * adv).mean()), abs=1e-6)


def test_gpg_loss_is_minus_advantage_times_log_prob(start, tmp_path, scripted):
    _step(_module(start, tmp_path, loss={"name": "gpg"}, advantage={"name": "gpg"}))
    for call in scripted:
        expected = -(call["advantages"].unsqueeze(1) * call["log_probs"]).mean()
        assert float(call["value"]) == pytest.approx(float(expected), rel=1e-6, abs=1e-7)
    nonzero = sum(r != 0 for r in REWARDS)
    assert scripted[0]["metrics"]["policy/clipfrac"] == 0.0 and nonzero == 6  # GPG's alpha = 6 / 6


@pytest.mark.parametrize("kind", ["abs", "low_var_kl", "mse"])
def test_kl_kind_reaches_the_kl_term(start, tmp_path, scripted, kind):
    _step(_module(start, tmp_path, loss={"beta": 0.5, "kl_kind": kind}))
    second = scripted[1]  # after one optimizer step the policy has left the reference
    gap = second["log_probs"] - second["ref"]
    assert float(gap.abs().max()) > 1e-4
    expected = {"abs": gap.abs(), "mse": 0.5 * gap.square(), "low_var_kl": torch.exp(-gap) + gap - 1.0}[kind]
    assert float(second["metrics"]["losses/kl"]) == pytest.approx(float(expected.mean()), rel=1e-5)
    assert torch.allclose(expected, kl_penalty(second["log_probs"], second["ref"], kind))


def test_bad_names_fail_at_construction_naming_the_valid_ones(start, tmp_path):
    with pytest.raises(ValueError, match=r"unknown advantage 'nope'.*reinforce_plus_plus_baseline"):
        _module(start, tmp_path, advantage={"name": "nope"})
    with pytest.raises(ValueError, match=r"unknown loss 'nope'.*sapo"):
        _module(start, tmp_path, loss={"name": "nope"})
    with pytest.raises(ValueError, match=r"unknown kl_kind 'nope'.*low_var_kl"):
        _module(start, tmp_path, loss={"kl_kind": "nope"})
    with pytest.raises(ValueError, match=r"loss 'sapo' has no clip bounds: \{'clip_high': 0.3\}"):
        _module(start, tmp_path, loss={"name": "sapo", "clip_high": 0.3})
    with pytest.raises(ValueError, match="tau_pos"):  # the loss's own settings are checked too
        _module(start, tmp_path, loss={"name": "sapo", "settings": {"tau_pos": -1.0}})
    with pytest.raises(ValueError, match="gamma_typo"):
        _module(start, tmp_path, advantage={"name": "reinforce_plus_plus", "settings": {"gamma_typo": 0.9}})
    with pytest.raises(ValueError, match=r"advantage.settings \['mask'\] are provided by the module"):
        _module(start, tmp_path, advantage={"name": "opo", "settings": {"mask": None}})


def test_ratio_level_and_loss_that_agree_are_accepted(start, tmp_path):
    assert rl.check_loss_choice("token", "ppo", None, 0.2, 0.2, "k3", "token-mean") == "ppo"
    assert rl.check_loss_choice("sequence", "cispo", None, 0.2, 0.2, "k3", "token-mean") == "cispo"
    assert rl.check_loss_choice("sequence_masked", None, None, 0.2, 0.2, "k3", "token-mean") == "gspo"
    with pytest.raises(ValueError, match=r"ratio_level 'token' selects loss 'ppo' but loss is 'sapo'"):
        rl.check_loss_choice("token", "sapo", None, 0.2, 0.2, "k3", "token-mean")
    module = _module(start, tmp_path, loss={"name": "gspo"})  # the old ratio_level sequence_masked
    assert module.loss.name == "gspo"


def test_null_clip_bounds_leave_the_loss_its_own_defaults(start, tmp_path, scripted):
    """``clip_low: null`` is the loss's own default (ppo 0.2), as in the VLM modules; sapo accepts nulls."""
    _step(_module(start, tmp_path, loss={"name": "ppo", "clip_low": None, "clip_high": None}, optim={"mu": 1}))
    assert scripted[0]["clip_low"] is None and scripted[0]["clip_high"] is None
    assert rl.check_loss_choice("sequence", "sapo", None, None, None, "k3", "token-mean") == "sapo"


def test_advantage_eps_reaches_the_estimator(start, tmp_path, scripted):
    _step(_module(start, tmp_path, advantage={"name": "grpo", "eps": 0.5}, optim={"mu": 1}))
    expected = compute_advantages("grpo", torch.tensor(REWARDS), GROUP_IDS, eps=0.5)
    assert torch.allclose(scripted[0]["advantages"], expected, atol=1e-6)
    assert not torch.allclose(expected, compute_advantages("grpo", torch.tensor(REWARDS), GROUP_IDS), atol=1e-3)


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_estimators_needing_token_statistics_fail_clearly(start, tmp_path, name):
    with pytest.raises(ValueError, match=rf"advantage '{name}' needs the input\(s\) \['old_log_probs', "
                                         r"'sum_pi_squared'\], which the dLLM module does not compute"):
        _module(start, tmp_path, advantage={"name": name})


def _fit_grpo_tiny(start, out, *overrides: str) -> list[dict[str, str]]:
    """``mmpo fit -c configs/dllm/grpo_tiny.yaml`` shrunk to the tiny test model (G 2, L 8, 2 prompts a batch)
    with ``overrides`` after it; the metrics.csv rows of the newest run that logged a policy loss."""
    import csv

    from mmpo.cli import main

    main([
        "fit", "-c", str(REPO / "configs/dllm/grpo_tiny.yaml"), f"--model.init_args.model_path={start}",
        "--model.init_args.warmup_config=null", f"--model.init_args.save_dir={out / 'model'}",
        f"--trainer.default_root_dir={out}", f"--trainer.callbacks.init_args.dirpath={out / 'ckpt'}",
        "--model.init_args.group_size=2", "--model.init_args.sampler.gen_length=8", "--model.init_args.sampler.steps=4",
        "--trainer.max_steps=2", "--trainer.enable_progress_bar=false", "--model.init_args.rewards.timeout_s=null",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.init_args.save_dir={out}",
        "--data.init_args.batch_size=2", "--data.init_args.train_size=8", "--data.init_args.test_size=4",
        "--data.init_args.val_size=2", *overrides,
    ])
    newest = max(out.rglob("metrics.csv"), key=lambda path: path.stat().st_mtime)
    with open(newest) as handle:
        return [r for r in csv.DictReader(handle) if r.get("losses/policy")]


def test_config_override_trains_two_steps_through_mmpo_fit(start, tmp_path, monkeypatch):
    """``mmpo fit -c configs/dllm/grpo_tiny.yaml --model.init_args.advantage.name=opo`` (+ loss fields and
    ``optim.lr``) on a tiny model: the command line sets fields over the YAML's groups."""
    import yaml

    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    rows = _fit_grpo_tiny(start, out, "--model.init_args.advantage.name=opo", "--model.init_args.loss.name=sapo",
                          "--model.init_args.loss.kl_kind=low_var_kl", "--model.init_args.optim.lr=3e-4",
                          "--model.init_args.loss.settings={tau_pos: 1.0, tau_neg: 1.2}")
    assert len(rows) == 1  # 2 optimizer steps = 1 batch x optim.mu 2
    assert torch.isfinite(torch.tensor(float(rows[0]["losses/policy"])))
    # the logged lr is the next step's: step 3 of the YAML's 5-step warm-up of the command line's lr
    assert float(rows[0]["lr"]) == pytest.approx(3e-4 * 3 / 5)
    hparams = yaml.safe_load((sorted(out.rglob("hparams.yaml"))[-1]).read_text())
    assert hparams["advantage"]["name"] == "opo" and hparams["loss"]["name"] == "sapo"
    assert hparams["loss"]["kl_kind"] == "low_var_kl" and hparams["loss"]["settings"] == {"tau_pos": 1.0, "tau_neg": 1.2}
    # the fields the command line left alone keep the YAML's values, the others the module's defaults
    assert (hparams["optim"]["lr"], hparams["optim"]["mu"], hparams["optim"]["warmup_steps"]) == (3e-4, 2, 5)
    assert hparams["loss"]["beta"] == 0.01 and list(hparams["optim"]["betas"]) == [0.9, 0.99]


def test_remax_greedy_rollout_leaves_the_sampled_rollouts_unchanged(start, tmp_path):
    """Real sampler: the greedy baseline rollout (after the sampled ones, on its own generator) does not change
    what ``advantage: remax`` samples, and its baseline is one value per prompt's group."""
    plain = _module(start, tmp_path).collect(ROWS)
    remax = _module(start, tmp_path, advantage={"name": "remax"}).collect(ROWS)
    assert torch.equal(plain["completions"], remax["completions"])
    assert torch.equal(plain["rewards"], remax["rewards"])
    assert "reward_baselines" not in plain
    baselines = remax["reward_baselines"]
    assert baselines.shape == (6,) and torch.equal(baselines, baselines[::3].repeat_interleave(3))


# ---------------------------------------------------------------------- LSPO and SFPO on the dLLM module (mmpo/dllm/variants.py)


def test_lspo_keeps_the_short_band(start, tmp_path, scripted, monkeypatch):
    from mmpo.dllm.variants import LSPODiffuGRPO, completion_lengths

    module = LSPODiffuGRPO(**_settings(start, tmp_path, optim={"mu": 1}))
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
    from mmpo.dllm.variants import SFPODiffuGRPO

    # K = 1, alpha = 1, one inner update per pass: fast step, reposition onto it, slow step = 2 plain steps
    one_update = {"optim": {"mu": 1}, "loss": {"beta": 0.01}}
    sfpo = _step(SFPODiffuGRPO(**_settings(start, tmp_path, **one_update), sfpo_inner_steps=1, sfpo_alpha=1.0))
    plain = _step(_module(start, tmp_path, optim={"mu": 2}, loss={"beta": 0.01}))
    half = _step(SFPODiffuGRPO(**_settings(start, tmp_path, **one_update), sfpo_inner_steps=1, sfpo_alpha=0.5))
    for name, weight in plain.items():
        assert torch.equal(sfpo[name], weight), name
    assert any(not torch.equal(half[name], weight) for name, weight in plain.items())
    assert all(call["old"].equal(scripted[0]["old"]) for call in scripted)  # pi_old stays theta_0's


def _settings(start, tmp_path, **overrides) -> dict:
    """The tiny module's init arguments; a group in ``overrides`` sets some of its fields over these."""
    settings = dict(model_path=start, warmup_config=None, save_dir=str(tmp_path / "out"), group_size=3,
                    optim={"mu": 2, "lr": 1e-2, "warmup_steps": 0, "max_grad_norm": 1e9}, igpo={"enabled": False},
                    loss={"beta": 0.0}, rewards={"weights": {"correct": 1.0, "derivation": 1.0}, "timeout_s": None},
                    overwrite_output=True, sampler=SamplerConfig(gen_length=GEN, block_length=8, steps=4),
                    hints=HintConfig(min_chunk=1, max_chunk=2, free_tail=1))
    return merged_settings(settings, overrides, groups=DLLM_GROUPS)


# ---------------------------------------------------------------------- EPO and HAPO on the dLLM module (mmpo/dllm/variants.py)


def _masked_completion_entropy(module: rl.DiffuGRPO, prompt: torch.Tensor) -> torch.Tensor:
    """(6, GEN) entropy, in plain torch, of the mask predictor's distribution at every completion position with the
    whole completion masked after ``prompt`` (6, P) (the one-pass estimator of the loss)."""
    canvas = torch.cat([prompt, torch.full((6, GEN), module.mask_id)], 1)
    with torch.no_grad():
        logits = module.model(input_ids=canvas, attention_mask=torch.ones_like(canvas)).logits[:, prompt.shape[1]:]
    return -(logits.float().softmax(-1) * logits.float().log_softmax(-1)).sum(-1)


def _epo(start, tmp_path, **overrides):
    from mmpo.dllm.variants import EPODiffuGRPO

    return EPODiffuGRPO(**_settings(start, tmp_path, **overrides))


def test_epo_terms_by_hand(start, tmp_path):
    module = _epo(start, tmp_path)
    entropy = torch.tensor([[0.2, 1.0, 2.0], [1.4, 0.6, 5.0]], requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    parts, metrics = module.extra_loss_terms(entropy, mask)
    # no history yet: P = 0; H = token mean over the 5 loss tokens = 5.2 / 5
    assert float(parts["entropy"].detach()) == pytest.approx(5.2 / 5) and parts.coefficient("entropy") == -0.001
    assert float(parts["epo_smooth"]) == 0.0 and metrics["epo/history_mean"] == 0.0
    parts.total().backward()
    # d(-lambda_H * H)/dH_t = -0.001 / 5 on each loss token, 0 on the masked-out one
    assert torch.allclose(entropy.grad, torch.tensor([[-0.0002] * 3, [-0.0002, -0.0002, 0.0]]))
    entropy.grad = None
    module.entropy_history.update(0.8)
    module.entropy_history.update(1.2)  # H_hist = 1.0: band (0.5, 1.5)
    parts, metrics = module.extra_loss_terms(entropy, mask)
    # P = 0.1 on the tokens 0.2 and 2.0 -> token mean 0.2 / 5; coefficient lambda_H * kappa = 0.001
    assert float(parts["epo_smooth"]) == pytest.approx(0.04) and parts.coefficient("epo_smooth") == 0.001
    assert float(metrics["epo/within_frac"]) == pytest.approx(0.6) and metrics["epo/history_mean"] == 1.0
    parts.total().backward()  # P is a constant: the gradient is the bonus's alone
    assert torch.allclose(entropy.grad, torch.tensor([[-0.0002] * 3, [-0.0002, -0.0002, 0.0]]))
    per_sequence = _epo(start, tmp_path, loss={"agg": "seq-mean-token-mean"}, epo_mask_mode="seq")
    per_sequence.entropy_history.load_state_dict(module.entropy_history.state_dict())
    parts, metrics = per_sequence.extra_loss_terms(entropy, mask)
    # rows' mean entropies 3.2 / 3 = 1.067 and 2.0 / 2 = 1.0, both inside (0.5, 1.5): P = 0
    assert float(parts["entropy"].detach()) == pytest.approx((3.2 / 3 + 2.0 / 2) / 2)
    assert float(parts["epo_smooth"]) == 0.0 and float(metrics["epo/within_frac"]) == 1.0
    per_sequence.entropy_history.load_state_dict({"total": 0.5, "count": 1})  # band (0.25, 0.75): both rows out
    parts, _ = per_sequence.extra_loss_terms(entropy, mask)
    assert float(parts["epo_smooth"]) == pytest.approx(0.1)  # mean over rows of each row's mean P (0.1)
    with pytest.raises(ValueError, match="epo_mask_mode"):
        _epo(start, tmp_path, epo_mask_mode="sequence")
    with pytest.raises(ValueError, match="entropy_coef"):
        _epo(start, tmp_path, loss={"entropy_coef": 0.0})


def test_epo_step_adds_the_mask_predictors_entropy_to_the_loss(start, tmp_path, scripted):
    module = _epo(start, tmp_path, optim={"mu": 1}, loss={"entropy_coef": 0.5})
    # every position is in the loss; the scripted prompts are all ones
    expected_entropy = float(_masked_completion_entropy(module, torch.ones(6, 3, dtype=torch.long)).mean())
    returned = []
    plain_update = module.update_policy

    def recording_update(*args, **kwargs):
        metrics, loss = plain_update(*args, **kwargs)
        returned.append(float(loss))
        return metrics, loss

    module.update_policy = recording_update
    weights = _step(module)
    logged = module.trainer.callback_metrics
    assert float(logged["entropy"]) == pytest.approx(expected_entropy, rel=1e-5)
    assert float(logged["losses/entropy"]) == pytest.approx(expected_entropy, rel=1e-5)
    assert float(logged["losses/epo_smooth"]) == 0.0  # no history on the first step
    # the loss stepped on: igpo_loss's value - lambda_H * H
    assert returned[0] == pytest.approx(float(scripted[0]["value"]) - 0.5 * expected_entropy, rel=1e-5)
    assert module.entropy_history.count == 1
    assert module.entropy_history.mean == pytest.approx(expected_entropy, rel=1e-5)
    plain = _step(_module(start, tmp_path, optim={"mu": 1}))
    # the bonus carries gradient (the entropy is not detached): the weights move differently
    assert any(not torch.equal(weight, plain[name]) for name, weight in weights.items())


def test_epo_penalty_changes_the_loss_not_the_weights(start, tmp_path, scripted):
    # a band (0.1, 0.5) x H_hist that no token's entropy (about H_hist) is in on the second step: P everywhere
    band = dict(optim={"mu": 1}, epo_min_ratio=0.1, epo_max_ratio=0.5)
    small, large = _epo(start, tmp_path, **band, epo_penalty=0.1), _epo(start, tmp_path, **band, epo_penalty=5.0)
    small_weights, large_weights = _step(small, batches=2), _step(large, batches=2)
    assert float(small.trainer.callback_metrics["epo/within_frac"]) == 0.0
    assert float(small.trainer.callback_metrics["losses/epo_smooth"]) == pytest.approx(0.1)  # token mean of P
    assert float(large.trainer.callback_metrics["losses/epo_smooth"]) == pytest.approx(5.0)
    for name, weight in small_weights.items():  # P is a constant: no gradient, the same weights
        assert torch.equal(weight, large_weights[name]), name


def test_epo_fit_history_and_resume_from_last_ckpt(start, tmp_path, monkeypatch):
    """``mmpo fit -c configs/dllm/grpo_tiny.yaml --model.class_path=mmpo.dllm.variants.EPODiffuGRPO``: step 2's H_hist is
    step 1's entropy; the history is read back from last.ckpt and a run resumed from it continues it."""
    from mmpo.dllm.variants import EPODiffuGRPO

    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    epo = ["--model.class_path=mmpo.dllm.variants.EPODiffuGRPO", "--model.init_args.optim.mu=1",
           "--trainer.callbacks.init_args.every_n_train_steps=1"]
    rows = _fit_grpo_tiny(start, out, *epo)
    assert len(rows) == 2  # 2 optimizer steps = 2 batches x optim.mu 1
    first, second = (float(r["entropy"]) for r in rows)
    assert float(rows[0]["epo/history_mean"]) == 0.0  # step 1 has no history
    assert float(rows[1]["epo/history_mean"]) == pytest.approx(first, rel=1e-6)
    assert float(rows[1]["losses/entropy"]) == pytest.approx(second, rel=1e-6)  # token-mean: H = the logged entropy
    checkpoint = torch.load(out / "ckpt" / "last.ckpt", weights_only=False, map_location="cpu")
    state = checkpoint["epo_entropy_history"]
    assert state["count"] == 2 and state["total"] == pytest.approx(first + second, rel=1e-6)
    restored = EPODiffuGRPO(**_settings(start, tmp_path))
    assert restored.entropy_history.mean is None
    restored.on_load_checkpoint(checkpoint)
    assert restored.entropy_history.mean == pytest.approx((first + second) / 2, rel=1e-6)
    resumed = _fit_grpo_tiny(start, out, *epo, "--trainer.max_steps=3", f"--ckpt_path={out / 'ckpt' / 'last.ckpt'}")
    assert len(resumed) == 1  # the third step only
    assert float(resumed[0]["epo/history_mean"]) == pytest.approx((first + second) / 2, rel=1e-6)


def _h_hat_by_hand(entropy: torch.Tensor, signed: bool) -> torch.Tensor:
    """HAPO's h^ in plain torch: x = log H, m = sorted x[round(0.8 (n - 1))], s = sqrt(mean((x - m)^2)),
    h = (x - m) / s; h / max(h) where h > 0, else h / min(h) (official: h^ >= 0) or h / -min(h) (signed)."""
    x = entropy.log()
    pivot = x.flatten().sort().values[round(0.8 * (x.numel() - 1))]
    h = (x - pivot) / (x - pivot).square().mean().sqrt()
    return torch.where(h > 0, h / h.max(), h / (-h.min() if signed else h.min()))


def _hapo_loss_by_hand(h_hat: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor) -> float:
    """HAPO's token-mean loss for advantages A > 0 or at r = 1 (where the dual clip does nothing), eps 0.2 / 0.2,
    alpha = beta = 1: adaptive bounds, redistribution inside / outside the neutral zone, PPO clip."""
    advantages = advantages.unsqueeze(-1).expand_as(ratio)
    low = torch.where(h_hat <= 0, 0.2 * (1 - h_hat), torch.tensor(0.2))
    high = torch.where(h_hat > 0, 0.2 * (1 + h_hat), torch.tensor(0.2))
    entropic = advantages * (1 + h_hat)
    inside = (ratio > 1 - low / 2) & (ratio < 1 + high / 2)
    adv = torch.where(h_hat > 0, torch.where(inside, advantages, entropic), torch.where(inside, entropic, advantages))
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)
    return float(per_token.mean())


@pytest.mark.parametrize("signed, expected", [(False, -1.25), (True, -0.8125)])
def test_hapo_loss_on_a_hand_batch(start, tmp_path, signed, expected):
    from mmpo.dllm.igpo import igpo_loss
    from mmpo.dllm.variants import HAPODiffuGRPO

    module = HAPODiffuGRPO(**_settings(start, tmp_path), hapo_signed_entropy=signed)
    entropy = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).exp()
    ratio = torch.tensor([[1.0, 1.3, 1.05, 0.5]])
    # m = x[round(2.4)] = 2, s = sqrt(1.5): h^ = (1, 0.5, 0, 1) officially, (-1, -0.5, 0, 1) signed
    h_hat = _h_hat_by_hand(entropy, signed)
    assert torch.allclose(h_hat, torch.tensor([[-1.0, -0.5, 0.0, 1.0]] if signed else [[1.0, 0.5, 0.0, 1.0]]))
    # official, A = 1: token 0 inside its zone keeps A (-1); token 1 outside takes 1.5 A, capped at 1.3 (-1.95);
    # token 2 (h^ = 0) inside takes A (1 + 0) (-1.05); token 3 below the zone takes 2 A, clipped at 0.8:
    # -min(0.5 x 2, 0.8 x 2) = -1; mean -1.25. Signed: 0, -1.2, -1.05, -1; mean -0.8125
    assert _hapo_loss_by_hand(h_hat, ratio, torch.ones(1)) == pytest.approx(expected)
    loss, metrics = igpo_loss(ratio.log(), torch.zeros(1, 4), None, torch.ones(1), torch.ones(1, 4), beta=0.0,
                              loss=module.loss.name, loss_settings=module.loss.settings,
                              entropy=entropy)
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    assert float(metrics["policy/hapo_high_entropy"]) == pytest.approx(0.25 if signed else 0.75)


@pytest.mark.parametrize("signed", [False, True])
def test_hapo_step_feeds_the_update_entropy_to_the_loss(start, tmp_path, scripted, monkeypatch, signed):
    from mmpo.dllm.variants import HAPODiffuGRPO

    # one prompt per row, so the rows' entropies differ (with the one-pass estimator a row's entropies depend on
    # its prompt alone: every completion position is a mask token)
    prompts = (torch.arange(6).unsqueeze(1) + torch.arange(3)) % 7
    original = rl.rollout

    def with_prompts(*args, **kwargs):
        out = original(*args, **kwargs)
        return Rollout(prompts.clone(), out.prompt_attention_mask, out.completions, out.fixed_mask, out.texts)

    monkeypatch.setattr(rl, "rollout", with_prompts)
    module = HAPODiffuGRPO(**_settings(start, tmp_path, optim={"mu": 1}), hapo_signed_entropy=signed)
    entropy = _masked_completion_entropy(module, prompts)
    _step(module)
    call = scripted[0]
    assert call["loss"] == "hapo" and call["loss_settings"]["dual_clip"] == 10.0
    assert torch.allclose(call["entropy"], entropy, rtol=1e-5)
    advantages = compute_advantages("hapo", torch.tensor(REWARDS), GROUP_IDS, mask=torch.ones(6, GEN))
    assert torch.allclose(call["advantages"], advantages, atol=1e-6)
    # on-policy (r = 1: inside every neutral zone): h^ > 0 tokens keep A, the others take A (1 + h^). h^ from the
    # entropy the loss got (equal to the one above to 1e-5; a row's positions are near-ties, so the pivot's rank
    # is sensitive to the last bits)
    h_hat = _h_hat_by_hand(call["entropy"], signed)
    by_hand = _hapo_loss_by_hand(h_hat, torch.ones(6, GEN), advantages[:, 0])
    assert float(call["value"]) == pytest.approx(by_hand, abs=1e-5)
    share = float((h_hat > 0).float().mean())
    assert float(module.trainer.callback_metrics["policy/hapo_high_entropy"]) == pytest.approx(share)
    assert 0 < share < 1


def test_hapo_fit_two_steps_through_mmpo_fit(start, tmp_path, monkeypatch):
    """``mmpo fit -c configs/dllm/grpo_tiny.yaml --model.class_path=mmpo.dllm.variants.HAPODiffuGRPO``."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    import yaml

    rows = _fit_grpo_tiny(start, out, "--model.class_path=mmpo.dllm.variants.HAPODiffuGRPO",
                          "--model.init_args.loss.beta=0.0", "--model.init_args.optim.mu=1")
    assert len(rows) == 2
    hparams = yaml.safe_load((sorted(out.rglob("hparams.yaml"))[-1]).read_text())
    assert hparams["loss"]["name"] == "hapo" and hparams["advantage"]["name"] == "hapo"
    for row in rows:
        assert torch.isfinite(torch.tensor(float(row["losses/policy"])))
        # G = 2 with equal lengths: |A| <= 1 < 5, so no group falls back to GRPO's advantage
        assert float(row["advantages/hapo_fallback_groups"]) == 0.0
        # 2 prompts x G 2 x 8 positions; a group's two rows share their entropies (same prompt, completion all
        # masked), so tokens with h^ > 0 come in pairs, and the pivot's copies (h = 0) are not among them
        high = float(row["policy/hapo_high_entropy"]) * 32
        assert high == pytest.approx(round(high)) and round(high) % 2 == 0 and high <= 30
