"""DiffuGRPO's collect step with scripted rollouts: rewards, format reward, trigger, replacement, masking."""

from __future__ import annotations

import pytest
import torch

import mmpo.dllm.rl as rl
from mmpo.dllm.config import DLLM_GROUPS
from mmpo.dllm.hints import HintConfig
from mmpo.dllm.modeling import save_mask_predictor
from mmpo.dllm.rewards import derivation_format_reward
from mmpo.dllm.rollout import Rollout
from mmpo.dllm.sampler import SamplerConfig
from mmpo.training.config import merged_settings

GEN = 8


@pytest.fixture
def start(tiny_model_and_tokenizer, tmp_path):
    model, tokenizer = tiny_model_and_tokenizer
    save_mask_predictor(model, tokenizer, tmp_path / "start")
    return str(tmp_path / "start")


def _module(start, tmp_path, **overrides):
    """A DiffuGRPO on the tiny model; a group in ``overrides`` sets some of its fields over these."""
    settings = dict(model_path=start, warmup_config=None, save_dir=str(tmp_path / "out"), group_size=2,
                    optim={"mu": 2}, igpo={"enabled": True, "max_replacements": 1}, loss={"beta": 0.0},
                    sampler=SamplerConfig(gen_length=GEN, block_length=8, steps=4),
                    hints=HintConfig(min_chunk=1, max_chunk=2, free_tail=1))
    return rl.DiffuGRPO(**merged_settings(settings, overrides, groups=DLLM_GROUPS))


def _scripted(monkeypatch, plain: list[str], hinted: list[str]):
    """rollout() returns ``plain`` texts for normal calls and ``hinted`` for hinted ones."""
    calls = []

    def fake_rollout(model, tokenizer, problems, config, *, fixed_tokens=None, fixed_mask=None, generator=None):
        texts = hinted if fixed_tokens is not None else plain
        calls.append("hinted" if fixed_tokens is not None else "plain")
        assert len(texts) == len(problems)
        n = len(problems)
        completions = torch.arange(n * GEN).reshape(n, GEN) % 7 + (100 if fixed_tokens is not None else 0)
        fixed = fixed_mask if fixed_mask is not None else torch.zeros(n, GEN, dtype=torch.bool)
        return Rollout(torch.ones(n, 3, dtype=torch.long), torch.ones(n, 3, dtype=torch.long), completions, fixed, list(texts))

    monkeypatch.setattr(rl, "rollout", fake_rollout)
    return calls


ROWS = [{"problem": "1+2", "trace": "1+2=3\nA:3", "answer": "3"}, {"problem": "2*2", "trace": "2*2=4\nA:4", "answer": "4"}]


def test_format_reward_is_added_and_never_triggers_hints(start, tmp_path, monkeypatch):
    # group 0: one right, one wrong but well formatted; group 1: both wrong, one well formatted
    plain = ["1+2=3\nA:3", "1+2=4\nA:4", "2*2=5\nA:5", "junk"]
    calls = _scripted(monkeypatch, plain, hinted=["2*2=4\nA:4", "x"])
    module = _module(start, tmp_path, rewards={"weights": {"correct": 3.0, "derivation": 1.0}},
                     igpo={"enabled": False})
    batch = module.collect(ROWS)
    expected = [3.0 + 0.75, 0.75, 0.75, derivation_format_reward("junk")]
    assert batch["rewards"].tolist() == pytest.approx(expected)
    assert calls == ["plain"]  # igpo off: group 1 is all wrong (formatted or not) and stays so
    assert batch["metrics"]["igpo/frac_all_wrong"] == 0.5
    assert derivation_format_reward("junk") == 0.0
    assert batch["metrics"]["rewards/format/mean"] == pytest.approx(0.75 * 3 / 4)


def test_replaced_rollouts_bring_their_own_text_into_the_format_reward(start, tmp_path, monkeypatch):
    plain = ["1+2=3\nA:3", "1+2=4\nA:4", "2*2=5\nA:5", "junk"]
    hinted = ["A:4\n2*2=4", "2*2=4\nA:4"]  # the first is correct but badly ordered; the second well formed
    calls = _scripted(monkeypatch, plain, hinted)
    module = _module(start, tmp_path, rewards={"weights": {"correct": 1.0, "derivation": 1.0}},
                     igpo={"max_replacements": 2})
    batch = module.collect(ROWS)
    assert calls == ["plain", "hinted"]
    assert batch["metrics"]["igpo/num_replaced"] == 2.0
    group1 = sorted(batch["rewards"][2:].tolist())
    assert group1 == pytest.approx(sorted([1.0 + derivation_format_reward(t) for t in hinted]))
    assert batch["completions"][2:].min() >= 100  # the hinted completions replaced both rows


def test_a_weighted_format_reward_scales_the_format_term(start, tmp_path, monkeypatch):
    # group 0: one right and well formatted, one wrong and well formatted; format weight 2
    _scripted(monkeypatch, ["1+2=3\nA:3", "1+2=4\nA:4", "2*2=5\nA:5", "junk"], hinted=["x", "y"])
    module = _module(start, tmp_path, rewards={"weights": {"correct": 1.0, "derivation": 2.0}},
                     igpo={"enabled": False})
    batch = module.collect(ROWS)
    assert batch["rewards"].tolist() == pytest.approx([1.0 + 1.5, 1.5, 1.5, 0.0])
    assert batch["metrics"]["rewards/format/mean"] == pytest.approx(1.5 * 3 / 4)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"rewards": {"weights": {"correct": 1.0, "xml": 1.0}}},
     r"unknown rewards \['xml'\] in rewards.weights; valid: \['correct', 'derivation', 'xmlcount'\]"),
    ({"rewards": {"weights": {"derivation": 1.0}}}, "rewards.weights must name 'correct'"),
    ({"logprob": {"masking": "partial"}}, "masking must be 'full' or 'structured', got 'partial'"),
    ({"loss": {"agg": "sum"}}, "unknown agg 'sum'"),
    ({"loss": {"name": "seq"}}, "unknown loss 'seq'"),
    ({"logprob": {"masking": "structured", "diffusion_steps": 8, "min_timestep": 7}},
     "need 1 <= min_timestep <= diffusion_steps - 2, got 7 and 8"),
    ({"loss": {"dual_clip": 3.0}}, "loss.dual_clip is not supported by the dLLM module"),
    ({"loss": {"entropy_coef": 0.1}}, "loss.entropy_coef must be 0 here"),
    ({"advantage": {"dynamic_sampling": True}}, "advantage.dynamic_sampling is not supported"),
    ({"optim": {"minibatch_size": 2}}, "optim.minibatch_size must be null"),
    ({"optim": {"mu": 0}}, r"mu \(inner epochs\) must be >= 1, got 0"),
    ({"igpo": {"entropy_keep": 0.0}}, r"entropy_keep must be in \(0, 1\], got 0.0"),
    ({"group_size": 1}, "group_size must be >= 2 for group-relative advantages, got 1"),
])
def test_bad_settings_fail_clearly(start, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _module(start, tmp_path, **overrides)


def test_scoring_keys_full_and_structured(start, tmp_path):
    full = _module(start, tmp_path, optim={"mu": 3})
    assert full.scoring_keys() == [(0, 1.0)] * 3  # prompt visible, completion fully masked: one input
    d1 = _module(start, tmp_path, optim={"mu": 3}, logprob={"p_mask_prompt": 0.15})
    assert [ratio for _, ratio in d1.scoring_keys()] == [1.0] * 3
    assert len({seed for seed, _ in d1.scoring_keys()}) == 3  # one prompt-mask seed per inner step (d1)
    structured = _module(start, tmp_path, optim={"mu": 3}, logprob={"masking": "structured", "diffusion_steps": 128})
    keys = structured.scoring_keys()
    ratios = [ratio for _, ratio in keys]
    assert 30 / 128 <= ratios[0] <= 126 / 128 and ratios[-1] == 1.0 and ratios == sorted(ratios)
    assert keys == structured.scoring_keys()  # a function of (seed, global_step): same after a resume


def _fit_recording_lr(module, num_batches: int) -> list[float]:
    """Fit ``num_batches`` batches of ROWS; the learning rate seen by each optimizer step."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    seen: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # wrap step: record its lr
            optimizer = trainer.optimizers[0]
            if not getattr(optimizer, "_recording", False):
                original = optimizer.step

                def recorded(*args, **kwargs):
                    seen.append(optimizer.param_groups[0]["lr"])
                    return original(*args, **kwargs)

                optimizer.step, optimizer._recording = recorded, True

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=num_batches * module.optim.mu,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Record()])
    trainer.fit(module, DataLoader([ROWS] * num_batches, batch_size=None, collate_fn=lambda x: x))
    return seen


def test_schedule_steps_per_optimizer_step(start, tmp_path, monkeypatch):
    # warm-up 4 at mu = 2: the 4 optimizer steps of 2 batches run at 1/4, 2/4, 3/4, 4/4 of lr
    # (stepped per batch, as before, they ran at 1/4, 1/4, 2/4, 2/4)
    _scripted(monkeypatch, ["1+2=3\nA:3", "1+2=4\nA:4", "2*2=4\nA:4", "2*2=5"], hinted=["x", "y"])
    module = _module(start, tmp_path, optim={"lr": 1e-3, "warmup_steps": 4}, igpo={"enabled": False})
    assert _fit_recording_lr(module, 2) == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3], rel=1e-12)


def test_linear_decay_to_max_steps(start, tmp_path, monkeypatch):
    # the official run's linear decay: no warm-up, 4 optimizer steps -> 1, 3/4, 1/2, 1/4 of lr
    _scripted(monkeypatch, ["1+2=3\nA:3", "1+2=4\nA:4", "2*2=4\nA:4", "2*2=5"], hinted=["x", "y"])
    module = _module(start, tmp_path, optim={"lr": 1e-3, "warmup_steps": 0, "lr_schedule": "linear"},
                     igpo={"enabled": False})
    assert _fit_recording_lr(module, 2) == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4], rel=1e-12)
    with pytest.raises(ValueError, match="unknown schedule 'step'"):
        _module(start, tmp_path, optim={"lr_schedule": "step"})
