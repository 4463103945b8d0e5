"""NaN/inf never reach the weights (mmpo.training.nonfinite), in every family.

Each family gets a poisoned step between two finite ones: the poisoned step leaves weights
(incl. BC's EMA) AND optimizer state bit-identical and counts one skip; the next finite step
updates. ``max_consecutive_skips`` poisoned steps in a row stop the run with
NonFiniteTrainingError and no end-of-training export. Demo loading names the bad demo.
"""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import gymnasium as gym
import h5py
import lightning as L
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from torch.utils.data import DataLoader, TensorDataset

from mmpo.training.config import LossConfig, OptimConfig, RewardConfig, SamplingConfig
from mmpo.training.nonfinite import NonFiniteGuard, NonFiniteTrainingError

torch.set_num_threads(1)
NAN = float("nan")


# ----------------------------------------------------------------------------- helpers


def _snapshot(module: L.LightningModule, trainer: L.Trainer) -> SimpleNamespace:
    """Every parameter (trained, frozen, EMA) and every optimizer's per-parameter state, cloned."""
    weights = {name: p.detach().clone() for name, p in module.named_parameters()}
    states = [copy.deepcopy(opt.state_dict()["state"]) for opt in trainer.optimizers]
    return SimpleNamespace(weights=weights, states=states, skipped=module.nonfinite.skipped_steps)


class Snapshots(L.Callback):
    """State before every training batch and at the end of training."""

    def __init__(self) -> None:
        self.before: list[SimpleNamespace] = []
        self.end: SimpleNamespace | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before.append(_snapshot(pl_module, trainer))

    def on_train_end(self, trainer, pl_module):
        self.end = _snapshot(pl_module, trainer)


def _identical(a: SimpleNamespace, b: SimpleNamespace) -> bool:
    if a.weights.keys() != b.weights.keys() or len(a.states) != len(b.states):
        return False
    if not all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights):
        return False
    for sa, sb in zip(a.states, b.states):
        if sa.keys() != sb.keys():
            return False
        for index in sa:
            for key, value in sa[index].items():
                other = sb[index][key]
                same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
                if not same:
                    return False
    return True


def _check_middle_step_skipped(snaps: Snapshots) -> None:
    """Three steps, the middle one poisoned: before[1] -> before[2] unchanged, then an update."""
    assert len(snaps.before) == 3 and snaps.end is not None
    assert not _identical(snaps.before[0], snaps.before[1]), "the first (finite) step did not update"
    assert snaps.before[1].states[0], "the optimizer holds state after a finite step"
    assert _identical(snaps.before[1], snaps.before[2]), "the poisoned step changed weights or optimizer state"
    assert not _identical(snaps.before[2], snaps.end), "the finite step after the skip did not update"
    assert [s.skipped for s in snaps.before] == [0, 0, 1]
    assert snaps.end.skipped == 1


def _trainer(root, callbacks=(), **kwargs) -> L.Trainer:
    settings = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root)
    settings.update(kwargs)
    return L.Trainer(callbacks=list(callbacks), **settings)


# ----------------------------------------------------------------------------- the guard itself


def test_guard_counts_warns_and_stops_after_n_in_a_row(caplog):
    guard = NonFiniteGuard(max_consecutive_skips=3)
    with caplog.at_level(logging.WARNING, logger="mmpo.training.nonfinite"):
        assert guard.check(0, 1.0, 2.0)
        assert not guard.check(1, NAN, 2.0)
        assert not guard.check(2, 1.0, math.inf)
    assert "step 1: non-finite loss nan" in caplog.text and "step 2: non-finite gradient norm inf" in caplog.text
    assert (guard.skipped_steps, guard.consecutive_skips, guard.last_finite_step) == (2, 2, 0)
    assert guard.check(3, 0.5, 1.0)  # a finite step resets the run of skips, not the total
    assert (guard.skipped_steps, guard.consecutive_skips, guard.last_finite_step) == (2, 0, 3)
    restored = NonFiniteGuard(3)
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == {"skipped_steps": 2, "consecutive_skips": 0, "last_finite_step": 3}
    assert not guard.check(4, NAN, NAN) and not guard.check(5, NAN, 1.0)
    with pytest.raises(NonFiniteTrainingError, match=r"3 consecutive optimizer steps \(up to step 6\).*"
                                                     r"Last finite step: 3\..*last checkpoint is kept"):
        guard.check(6, 1.0, NAN)
    # one rank's bad value makes every rank skip (the reduce is an "any")
    assert not NonFiniteGuard().check(0, 1.0, 1.0, reduce=lambda bad: True)
    with pytest.raises(ValueError, match="max_consecutive_skips must be >= 1"):
        NonFiniteGuard(0)


# ----------------------------------------------------------------------------- BC (automatic optimisation)


def _bc_module(**kwargs):
    from mmpo.robotics.bc import BCModule

    torch.manual_seed(0)
    return BCModule(obs_dim=2, action_dim=1, horizon=2, act_steps=2, denoising_steps=3, hidden_dims=[16, 16],
                    lr=1e-2, lr_min=1e-2, warmup_steps=1, task="hold", **kwargs)


def _bc_data(poisoned_batches: set[int], batches: int = 3) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    obs = torch.rand(8 * batches, 2, generator=generator)
    actions = torch.rand(8 * batches, 2, 1, generator=generator)
    for b in poisoned_batches:
        actions[8 * b + 3, 1, 0] = NAN  # one NaN action in the batch, as from a bad demo
    return DataLoader(TensorDataset(obs, actions), batch_size=8, shuffle=False)


def test_bc_skips_a_nan_batch_and_keeps_weights_ema_and_adamw_state(tmp_path):
    snaps = Snapshots()
    module = _bc_module()
    trainer = _trainer(tmp_path, [snaps], max_epochs=1)
    trainer.fit(module, _bc_data({1}))
    _check_middle_step_skipped(snaps)
    assert trainer.global_step == 3  # the skipped step is still counted (schedule and max_steps advance)
    assert trainer.callback_metrics["perf/skipped_steps"].item() == 1.0
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert (tmp_path / "policy.safetensors").is_file()  # a run that ends normally exports

    # the counter is saved in the checkpoint and restored on resume
    path = tmp_path / "bc.ckpt"
    trainer.save_checkpoint(path)
    resumed = _bc_module()
    _trainer(tmp_path / "resumed", max_epochs=2).fit(resumed, _bc_data(set()), ckpt_path=str(path))
    assert resumed.nonfinite.skipped_steps == 1 and resumed.nonfinite.last_finite_step == 5


def test_bc_stops_after_max_consecutive_skips_without_exporting(tmp_path):
    module = _bc_module(max_consecutive_skips=2)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(NonFiniteTrainingError, match="2 consecutive optimizer steps.*Last finite step: 0"):
        _trainer(tmp_path, max_epochs=1).fit(module, _bc_data({1, 2}))
    assert not (tmp_path / "policy.safetensors").exists()  # on_train_end (the export) did not run
    assert module.nonfinite.skipped_steps == 2
    changed = [k for k, v in module.state_dict().items() if not torch.equal(v, before[k])]
    assert changed  # step 0 was finite and trained; steps 1-2 left only finite values behind
    assert all(torch.isfinite(v).all() for v in module.state_dict().values() if v.is_floating_point())


# ----------------------------------------------------------------------------- DPPO (manual, two optimizers)


class Hold1D(gym.Env):
    """obs (pos, 0); action = velocity; reward -|pos|."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
        self.action_space = gym.spaces.Box(-1, 1, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = float(self.np_random.uniform(-0.5, 0.5))
        return np.array([self.pos, 0.0], np.float32), {}

    def step(self, action):
        self.pos = float(np.clip(self.pos + 0.1 * float(np.clip(action[0], -1, 1)), -1, 1))
        return np.array([self.pos, 0.0], np.float32), -abs(self.pos), False, False, {"success": False}


def _hold_envs(num_envs: int, seed: int, act_steps: int) -> SyncVectorEnv:
    from mmpo.robotics.envs import ActionChunkWrapper

    makers = [lambda: ActionChunkWrapper(gym.wrappers.TimeLimit(Hold1D(), 8), act_steps)] * num_envs
    return SyncVectorEnv(makers, autoreset_mode=AutoresetMode.SAME_STEP)


def _dppo_module(tmp_path, poisoned_iterations: set[int], **kwargs):
    from mmpo.robotics.dppo import DPPOModule
    from mmpo.robotics.policy.io import save_policy_safetensors

    bc = _bc_module()
    path = tmp_path / "bc_policy.safetensors"
    save_policy_safetensors(bc.ema_policy.module, bc.robotics_metadata(), path)

    class PoisonedDPPO(DPPOModule):
        def compute_advantages(self, rollout):
            rollout = super().compute_advantages(rollout)
            if self.iteration in poisoned_iterations:
                rollout.advantages[0, 0] = NAN  # one NaN advantage: the normalised minibatch is all NaN
            return rollout

    torch.manual_seed(0)
    settings = dict(num_iterations=3, env={"num_envs": 2, "n_steps": 4, "asynchronous": False}, chain={"ft_steps": 2},
                    optim={"minibatch_size": 16, "mu": 1, "lr": 1e-2}, critic={"warmup_iterations": 0, "hidden_dims": [16]},
                    evaluation={"every": 0}, loss={"target_kl": None}, env_factory=_hold_envs)
    return PoisonedDPPO(str(path), **settings, **kwargs)


def test_dppo_ppo_update_skips_a_nan_advantage_for_actor_and_critic(tmp_path):
    snaps = Snapshots()
    module = _dppo_module(tmp_path, {1})
    trainer = _trainer(tmp_path, [snaps], max_epochs=1)
    trainer.fit(module)
    # one minibatch per iteration: iteration 1's (actor + critic) step was poisoned
    assert len(snaps.before[0].states) == 2  # actor and critic AdamW
    _check_middle_step_skipped(snaps)
    for index in (0, 1):  # both AdamWs have state and it did not move during the skip
        assert snaps.before[2].states[index]
    assert module.last_metrics["perf/skipped_steps"] == 1.0


def test_dppo_stops_after_max_consecutive_skips(tmp_path):
    module = _dppo_module(tmp_path, {0, 1, 2}, max_consecutive_skips=2)
    ft_before = [p.detach().clone() for p in module.policy.ft_network.parameters()]
    with pytest.raises(NonFiniteTrainingError, match="2 consecutive.*Last finite step: none"):
        _trainer(tmp_path, max_epochs=1).fit(module)
    assert all(torch.equal(a, b) for a, b in zip(ft_before, module.policy.ft_network.parameters()))


# ----------------------------------------------------------------------------- GRPO (manual, VLM)


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> str:
    from mmpo.data import SYSTEM_PROMPT
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [SYSTEM_PROMPT, "How many shapes? <think>3 shapes.</think><answer>3</answer> 0123456789"] * 10
    return str(build_tiny_vlm(tmp_path_factory.mktemp("vlm"), corpus=corpus, vocab_size=300, hidden_size=32,
                              intermediate_size=64))


def _vlm_rows():
    from mmpo.data.synthetic import make_items

    return make_items("count_shapes", 1, seed=0)


def _vlm_loader(batches: int) -> DataLoader:
    return DataLoader([_vlm_rows()] * batches, batch_size=None, collate_fn=lambda x: x)


def _grpo(tiny_vlm: str, poisoned_calls: set[int], **kwargs):
    from mmpo.algos.grpo import GRPOModule

    class PoisonedGRPO(GRPOModule):
        calls = 0

        def compute_rewards(self, rollout):
            return torch.tensor([1.0, 0.0, 0.5])[: len(rollout)], {}

        def compute_advantages(self, rewards, group_ids, rollout):
            advantages, metrics = super().compute_advantages(rewards, group_ids, rollout)
            self.calls += 1
            if self.calls in poisoned_calls:
                advantages = advantages.clone()
                advantages[0] = NAN
            return advantages, metrics

    torch.manual_seed(0)
    return PoisonedGRPO(tiny_vlm, sampling=SamplingConfig(num_generations=3, max_new_tokens=3),
                        loss=LossConfig(beta=0.0), optim=OptimConfig(lr=1e-2),
                        rewards=RewardConfig(timeout_s=None), **kwargs)


def test_grpo_skips_a_nan_advantage_step(tiny_vlm, tmp_path):
    snaps = Snapshots()
    module = _grpo(tiny_vlm, {2})
    _trainer(tmp_path, [snaps], max_steps=3).fit(module, _vlm_loader(3))
    _check_middle_step_skipped(snaps)
    assert module.last_metrics["perf/skipped_steps"] == 1.0


def test_grpo_stops_after_max_consecutive_skips_without_export(tiny_vlm, tmp_path):
    module = _grpo(tiny_vlm, {1, 2, 3}, max_consecutive_skips=3, output_dir=str(tmp_path / "hf"))
    with pytest.raises(NonFiniteTrainingError, match="3 consecutive optimizer steps"):
        _trainer(tmp_path, max_steps=5).fit(module, _vlm_loader(5))
    assert not (tmp_path / "hf").exists()  # on_fit_end's HF export did not run


# ----------------------------------------------------------------------------- VLM SFT (automatic)


def test_vlm_sft_skips_a_nan_loss_step(tiny_vlm, tmp_path):
    from mmpo.algos.sft import SFTModule

    class PoisonedSFT(SFTModule):
        calls = 0

        def sft_loss(self, rows):
            loss, metrics = super().sft_loss(rows)
            self.calls += 1
            return (loss * NAN if self.calls == 2 else loss), metrics

    snaps = Snapshots()
    module = PoisonedSFT(tiny_vlm, optim=OptimConfig(lr=1e-2))
    _trainer(tmp_path, [snaps], max_steps=3).fit(module, _vlm_loader(3))
    _check_middle_step_skipped(snaps)


# ----------------------------------------------------------------------------- dLLM RL and SFT


@pytest.fixture(scope="module")
def tiny_dllm(tmp_path_factory) -> str:
    from mmpo.dllm.modeling import TinyMaskPredictorConfig, build_tiny_mask_predictor, save_mask_predictor
    from mmpo.dllm.task import ArithmeticTaskConfig, corpus
    from mmpo.dllm.tokenizer import train_char_tokenizer

    torch.manual_seed(0)
    tokenizer = train_char_tokenizer(corpus(ArithmeticTaskConfig(), size=50))
    config = TinyMaskPredictorConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=64)
    path = tmp_path_factory.mktemp("dllm") / "start"
    save_mask_predictor(build_tiny_mask_predictor(tokenizer, config), tokenizer, path)
    return str(path)


DLLM_ROWS = [{"problem": "1+2", "trace": "1+2=3\nA:3", "answer": "3"}]


def test_dllm_rl_skips_a_nan_advantage_step(tiny_dllm, tmp_path, monkeypatch):
    import mmpo.dllm.rl as rl
    from mmpo.dllm.sampler import SamplerConfig

    calls = []
    real = rl.compute_advantages_with_metrics

    def poisoned(name, rewards, group_ids, **settings):
        calls.append(1)
        # scripted rewards: half right, so the advantages are non-zero; call 2 gets a NaN
        advantages, metrics = real(name, torch.tensor([1.0, 0.0]), group_ids, **settings)
        return (advantages * NAN if len(calls) == 2 else advantages), metrics

    monkeypatch.setattr(rl, "compute_advantages_with_metrics", poisoned)
    snaps = Snapshots()
    module = rl.DiffuGRPO(model_path=tiny_dllm, warmup_config=None, save_dir=str(tmp_path / "out"), group_size=2,
                          optim={"mu": 1, "lr": 1e-2, "warmup_steps": 1}, igpo={"enabled": False}, loss={"beta": 0.0},
                          sampler=SamplerConfig(gen_length=8, block_length=8, steps=2))
    calls.clear()  # the constructor dry-runs the estimator to check its settings: count training steps only
    loader = DataLoader([DLLM_ROWS] * 3, batch_size=None, collate_fn=lambda x: x)
    _trainer(tmp_path, [snaps], max_steps=3).fit(module, loader)
    _check_middle_step_skipped(snaps)


def _dllm_sft(tiny_dllm: str, tmp_path, poisoned_calls: set[int], **kwargs):
    from mmpo.dllm.sampler import SamplerConfig
    from mmpo.dllm.sft import MaskedDiffusionSFT

    class PoisonedSFT(MaskedDiffusionSFT):
        calls = 0

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.calls += 1
            return loss * NAN if self.calls in poisoned_calls else loss

    return PoisonedSFT(save_dir=str(tmp_path / "sft_out"), init_from=tiny_dllm, optim={"lr": 1e-2, "warmup_steps": 1},
                       sampler=SamplerConfig(gen_length=16, block_length=8, steps=2), **kwargs)


def test_dllm_sft_skips_a_nan_loss_step(tiny_dllm, tmp_path):
    snaps = Snapshots()
    module = _dllm_sft(tiny_dllm, tmp_path, {2})
    loader = DataLoader([DLLM_ROWS] * 3, batch_size=None, collate_fn=lambda x: x)
    _trainer(tmp_path, [snaps], max_steps=3).fit(module, loader)
    _check_middle_step_skipped(snaps)
    assert (tmp_path / "sft_out").is_dir()  # a normal end exports


def test_dllm_sft_stops_after_max_consecutive_skips_without_export(tiny_dllm, tmp_path):
    module = _dllm_sft(tiny_dllm, tmp_path, {1, 2}, max_consecutive_skips=2)
    loader = DataLoader([DLLM_ROWS] * 3, batch_size=None, collate_fn=lambda x: x)
    with pytest.raises(NonFiniteTrainingError, match="2 consecutive"):
        _trainer(tmp_path, max_steps=3).fit(module, loader)
    assert not (tmp_path / "sft_out").exists()


# ----------------------------------------------------------------------------- demo loading


def _demo_file(path, bad: tuple[str, str, int] | None = None):
    """demo_1..demo_3 with a 2-d ``state`` obs key; ``bad`` = (demo, "obs" | "actions", step) gets a NaN."""
    with h5py.File(path, "w") as handle:
        data = handle.create_group("data")
        for index in (1, 2, 3):
            name = f"demo_{index}"
            obs = np.full((5, 2), float(index))
            actions = np.full((5, 1), 0.1 * index)
            if bad is not None and bad[0] == name:
                (obs if bad[1] == "obs" else actions)[bad[2], -1] = np.nan
            group = data.create_group(name)
            group.create_dataset("actions", data=actions)
            group.create_group("obs").create_dataset("state", data=obs)
    return path


def test_demo_loader_names_the_nonfinite_demo_and_step_or_skips_it(tmp_path):
    from mmpo.robotics.data import ChunkDataset

    path = _demo_file(tmp_path / "demos.hdf5", ("demo_3", "actions", 2))
    with pytest.raises(ValueError, match=r"demos.hdf5: demo_3, step 2: actions\[0\] = nan"):
        ChunkDataset(path, horizon=2, obs_keys=("state",))
    dataset = ChunkDataset(path, horizon=2, obs_keys=("state",), on_nonfinite="skip")
    assert dataset.skipped_demos == ["demo_3"] and len(dataset) == 10
    assert all(torch.isfinite(torch.cat([o.flatten(), a.flatten()])).all() for o, a in dataset)

    obs_path = _demo_file(tmp_path / "obs.hdf5", ("demo_1", "obs", 4))
    with pytest.raises(ValueError, match=r"demo_1, step 4: obs\[1\] = nan"):
        ChunkDataset(obs_path, horizon=2, obs_keys=("state",))
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        ChunkDataset(obs_path, horizon=2, obs_keys=("state",), on_nonfinite="ignore")


# ----------------------------------------------------------------------------- `mmpo fit`, end to end


def _lift_like_demos(path, nan_action_in: str | None) -> None:
    """3 demos in the lift layout (19-d state, 7-d actions) and their stats file, as `mmpo demos` writes."""
    from mmpo.robotics.envs import Normalizer
    from mmpo.robotics.envs.tasks import ROBOMIMIC_LOW_DIM_KEYS

    dims = {"robot0_eef_pos": 3, "robot0_eef_quat": 4, "robot0_gripper_qpos": 2, "object": 10}
    rng = np.random.default_rng(0)
    finite_obs, finite_actions = [], []
    with h5py.File(path, "w") as handle:
        data = handle.create_group("data")
        for name in ("demo_1", "demo_2", "demo_3"):
            group = data.create_group(name)
            actions = rng.uniform(-1, 1, (12, 7))
            obs = {key: rng.uniform(-1, 1, (12, dims[key])) for key in ROBOMIMIC_LOW_DIM_KEYS}
            if name == nan_action_in:
                actions[7, 2] = np.nan
            else:
                finite_obs.append(np.concatenate([obs[k] for k in ROBOMIMIC_LOW_DIM_KEYS], 1))
                finite_actions.append(actions)
            group.create_dataset("actions", data=actions)
            for key, values in obs.items():
                group.create_dataset(f"obs/{key}", data=values)
    Normalizer.from_data(np.concatenate(finite_obs), np.concatenate(finite_actions)).save(f"{path}.stats.json")


def _fit_bc_config(path, *overrides: str) -> None:
    from mmpo.cli import main

    config = str(Path(__file__).resolve().parents[2] / "configs" / "robotics" / "bc_lift.yaml")
    main(["fit", "-c", config, f"--data.init_args.dataset_path={path}", "--data.init_args.batch_size=8",
          "--model.init_args.hidden_dims=[16, 16]", "--model.init_args.denoising_steps=3", "--trainer.max_epochs=2",
          "--trainer.enable_progress_bar=false", *overrides])


def test_mmpo_fit_bc_rejects_a_nan_demo_or_skips_it_and_exports_a_finite_policy(tmp_path, monkeypatch):
    from mmpo.robotics.policy.io import load_policy

    monkeypatch.chdir(tmp_path)  # the config writes under runs/bc_lift
    path = tmp_path / "demos.hdf5"
    _lift_like_demos(path, nan_action_in="demo_3")
    with pytest.raises(ValueError, match=r"demo_3, step 7: actions\[2\] = nan"):
        _fit_bc_config(path)
    assert not list(tmp_path.rglob("policy.safetensors"))

    _fit_bc_config(path, "--data.init_args.on_nonfinite=skip")
    exported = list(tmp_path.rglob("policy.safetensors"))
    assert len(exported) == 1
    policy, _ = load_policy(exported[0])
    assert all(torch.isfinite(p).all() for p in policy.parameters())


def test_mmpo_fit_bc_stops_on_repeated_nan_losses_without_exporting(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "demos.hdf5"
    _lift_like_demos(path, nan_action_in=None)
    # lr 1e30: the first AdamW step makes the weights ~1e30, every later forward overflows to NaN
    with pytest.raises(NonFiniteTrainingError, match=r"3 consecutive optimizer steps \(up to step 3\).*"
                                                     r"Last finite step: 0\."):
        _fit_bc_config(path, "--model.init_args.lr=1e30", "--model.init_args.lr_min=1e30",
                       "--model.init_args.max_consecutive_skips=3")
    assert not list(tmp_path.rglob("policy.safetensors"))
