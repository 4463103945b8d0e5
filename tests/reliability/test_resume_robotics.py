"""BC and DPPO resume bit-exactly: N + M steps uninterrupted == N steps, checkpoint, a fresh module and
Trainer (or a process killed with SIGKILL and `mmpo fit --ckpt_path`), M more steps. Every tensor of
the final checkpoint (weights, EMA and its n_averaged, optimizer and scheduler state) must be equal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from mmpo.robotics.bc import BCModule, ChunkDataModule
from mmpo.robotics.demos import RobomimicHDF5Writer
from mmpo.robotics.dppo import DPPOModule
from mmpo.robotics.envs import ActionChunkWrapper, Normalizer
from mmpo.robotics.envs.normalizer import DATA_HASH_KEY
from mmpo.files import file_sha256

REPO = Path(__file__).resolve().parents[2]
OBS_KEYS = {"robot0_eef_pos": 3, "robot0_eef_quat": 4, "robot0_gripper_qpos": 2, "object": 10}  # obs_dim 19


def write_tiny_demos(path: Path, num_demos: int = 3, length: int = 20) -> Path:
    """Random Lift-shaped demos (obs 19, action 7) in robomimic's layout, with stats beside them."""
    rng = np.random.default_rng(0)
    obs_all, actions_all = [], []
    with RobomimicHDF5Writer(path, {"env_name": "Lift", "type": 1, "env_kwargs": {}}) as writer:
        for _ in range(num_demos):
            obs = {key: rng.normal(size=(length, dim)) for key, dim in OBS_KEYS.items()}
            actions = rng.uniform(-1, 1, size=(length, 7))
            writer.add_demo(obs, obs, actions, np.zeros(length), np.zeros(length, np.int64), np.zeros((length, 3)))
            obs_all.append(np.concatenate(list(obs.values()), axis=1))
            actions_all.append(actions)
    stats = Normalizer.from_data(np.concatenate(obs_all), np.concatenate(actions_all), **{DATA_HASH_KEY: file_sha256(path)})
    stats.save(f"{path}.stats.json")
    return path


def assert_same_tensors(expected: Any, actual: Any, where: str = "checkpoint") -> int:
    """torch.equal on every tensor of two nested dict/list structures; returns how many were compared."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(expected, actual), f"{where} differs"
        return 1
    if isinstance(expected, dict):
        assert expected.keys() == actual.keys(), f"{where}: keys {sorted(expected)} != {sorted(actual)}"
        return sum(assert_same_tensors(expected[k], actual[k], f"{where}[{k!r}]") for k in expected)
    if isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), f"{where}: lengths differ"
        return sum(assert_same_tensors(e, a, f"{where}[{i}]") for i, (e, a) in enumerate(zip(expected, actual)))
    assert expected == actual, f"{where}: {expected!r} != {actual!r}"
    return 0


def training_state(path: Path) -> dict[str, Any]:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    return {key: checkpoint[key] for key in ("state_dict", "optimizer_states", "lr_schedulers", "global_step",
                                             "epoch", "dppo_state") if key in checkpoint}


# ---------------------------------------------------------------------------------------------- BC
@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> Path:
    return write_tiny_demos(tmp_path_factory.mktemp("demos") / "lift.hdf5")


def _bc_fit(demos: Path, root: Path, ckpt_path: Path | None = None) -> Path:
    """2 epochs x 8 batches (60 chunks, batch 8, the last one partial); a checkpoint after every step."""
    torch.manual_seed(0)
    module = BCModule(obs_dim=19, action_dim=7, horizon=4, act_steps=4, denoising_steps=5, hidden_dims=[32, 32, 32],
                      lr=1e-2, lr_min=1e-3, warmup_steps=3, ema_decay=0.9, export_safetensors=False, seed=7)
    data = ChunkDataModule(str(demos), horizon=4, batch_size=8, seed=3)
    checkpoints = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = pl.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[checkpoints], default_root_dir=root)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    assert trainer.global_step == 16
    return root / "step=16.ckpt"


@pytest.fixture(scope="module")
def bc_uninterrupted(demos, tmp_path_factory) -> Path:
    return _bc_fit(demos, tmp_path_factory.mktemp("bc_full"))


@pytest.mark.parametrize("resume_step", [5, 8, 11])  # mid-epoch, at the epoch boundary, in the second epoch
def test_bc_resume_is_bit_exact(demos, bc_uninterrupted, tmp_path, resume_step):
    resumed = _bc_fit(demos, tmp_path, ckpt_path=bc_uninterrupted.parent / f"step={resume_step}.ckpt")
    expected, actual = training_state(bc_uninterrupted), training_state(resumed)
    compared = assert_same_tensors(expected, actual)
    # weights + EMA copy + n_averaged, and AdamW's (step, exp_avg, exp_avg_sq) of every policy parameter
    num_params = len(list(BCModule(obs_dim=19, action_dim=7, denoising_steps=5, hidden_dims=[32, 32, 32],
                                   export_safetensors=False).policy.parameters()))
    assert compared == len(expected["state_dict"]) + 3 * num_params, compared
    assert int(actual["state_dict"]["ema_policy.n_averaged"]) == 17  # the initial copy + one update per step


def _bc_cli_args(demos: Path, root: Path, every_n_steps: int) -> list[str]:
    """`mmpo fit -c configs/robotics/bc_lift.yaml` at a tiny size: 40 epochs x 8 batches (long enough that
    the killed run is still going when the test sees its step-11 checkpoint)."""
    return [
        "fit", "-c", str(REPO / "configs" / "robotics" / "bc_lift.yaml"),
        "--data.init_args.dataset_path", str(demos), "--data.init_args.batch_size", "8",
        "--model.init_args.hidden_dims", "[16, 16, 16]", "--model.init_args.denoising_steps", "5",
        "--model.init_args.export_safetensors", "false", "--trainer.max_epochs", "40",
        "--trainer.default_root_dir", str(root), "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.callbacks.init_args.dirpath", str(root / "checkpoints"),
        "--trainer.callbacks.init_args.filename", "{step}", "--trainer.callbacks.init_args.every_n_epochs", "0",
        "--trainer.callbacks.init_args.every_n_train_steps", str(every_n_steps),
    ]


@pytest.mark.slow
def test_bc_fit_killed_with_sigkill_resumes_bit_exactly(demos, tmp_path):
    from mmpo.cli import main

    killed_root = tmp_path / "killed"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen([sys.executable, "-m", "mmpo.cli", *_bc_cli_args(demos, killed_root, every_n_steps=1)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    resume_from = killed_root / "checkpoints" / "step=10.ckpt"
    written_after = killed_root / "checkpoints" / "step=11.ckpt"  # so step 10's file is complete
    deadline = time.monotonic() + 240
    while not written_after.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    _, stderr = process.communicate()
    assert process.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    assert not (killed_root / "checkpoints" / "step=320.ckpt").exists()  # it really died mid-run

    # the resumed and the reference run go in-process (one interpreter start-up is the test's main cost)
    main([*_bc_cli_args(demos, tmp_path / "resumed", every_n_steps=320), "--ckpt_path", str(resume_from)])
    main(_bc_cli_args(demos, tmp_path / "uninterrupted", every_n_steps=320))
    expected = training_state(tmp_path / "uninterrupted" / "checkpoints" / "step=320.ckpt")
    actual = training_state(tmp_path / "resumed" / "checkpoints" / "step=320.ckpt")
    assert expected["global_step"] == 320
    assert assert_same_tensors(expected, actual) > len(expected["state_dict"])


# -------------------------------------------------------------------------------------------- DPPO
def _pendulum_envs(num_envs: int, seed: int, act_steps: int) -> gym.vector.SyncVectorEnv:
    """Cheap in-process chunk envs (classic-control Pendulum, 12-step episodes), SAME_STEP autoreset."""
    make = lambda: ActionChunkWrapper(gym.wrappers.TimeLimit(gym.make("Pendulum-v1").unwrapped, 12), act_steps)  # noqa: E731
    return gym.vector.SyncVectorEnv([make] * num_envs, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


@pytest.fixture(scope="module")
def pendulum_bc_checkpoint(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    bc = BCModule(obs_dim=3, action_dim=1, horizon=2, act_steps=2, denoising_steps=5, hidden_dims=[16, 16, 16],
                  export_safetensors=False, task="pendulum")
    path = tmp_path_factory.mktemp("bc") / "bc.ckpt"
    torch.save({"state_dict": bc.state_dict(), "robotics": bc.robotics_metadata()}, path)
    return path


class _SaveAfterIterations(pl.Callback):
    """Checkpoint after the given DPPO iterations (global_step counts optimizer steps, not iterations)."""

    def __init__(self, root: Path, iterations: set[int]) -> None:
        self.root, self.iterations = root, iterations

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if module.iteration in self.iterations:
            trainer.save_checkpoint(self.root / f"iteration={module.iteration}.ckpt")


def _dppo_fit(bc_checkpoint: Path, root: Path, ckpt_path: Path | None = None, **env: Any) -> DPPOModule:
    """4 iterations: critic warm-up, then actor + critic; evaluation at iterations 0, 2 and 3."""
    torch.manual_seed(0)
    module = DPPOModule(str(bc_checkpoint), num_iterations=4, env={"num_envs": 3, "n_steps": 6, **env},
                        chain={"ft_steps": 3}, optim={"minibatch_size": 12, "mu": 2, "lr": 1e-3},
                        critic={"warmup_iterations": 1, "hidden_dims": [16, 16]},
                        evaluation={"every": 2, "episodes": 3}, returns={"gamma": 0.99}, loss={"target_kl": None},
                        seed=5, env_factory=_pendulum_envs)
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[_SaveAfterIterations(root, {2, 4})],
                         default_root_dir=root)
    trainer.fit(module, ckpt_path=ckpt_path)
    assert module.iteration == 4
    return module


@pytest.mark.parametrize("env_groups", [1, 2])
def test_dppo_resume_is_bit_exact(pendulum_bc_checkpoint, tmp_path, env_groups):
    """Also with pipelined collection (env_groups=2: envs [2, 1] in two groups; evaluation steps all of them)."""
    full = _dppo_fit(pendulum_bc_checkpoint, tmp_path / "full", env_groups=env_groups)
    resumed = _dppo_fit(pendulum_bc_checkpoint, tmp_path / "resumed", tmp_path / "full" / "iteration=2.ckpt",
                        env_groups=env_groups)
    expected = training_state(tmp_path / "full" / "iteration=4.ckpt")
    actual = training_state(tmp_path / "resumed" / "iteration=4.ckpt")
    # policy (frozen base + fine-tuned copy) and critic, both AdamW states, the generator and RNG streams,
    # the reward scaler's statistics
    assert assert_same_tensors(expected, actual) > len(expected["state_dict"]) + 10
    assert actual["dppo_state"]["iteration"] == 4 and actual["dppo_state"]["env_steps"] == 4 * 3 * 6 * 2
    assert len(expected["optimizer_states"]) == 2
    # the metrics of the last iteration (rollout returns, losses, evaluation) agree too
    assert full.last_metrics.keys() == resumed.last_metrics.keys()
    assert "eval/return" in full.last_metrics
    for key, value in full.last_metrics.items():
        if key.startswith("perf/env_steps_per_s"):
            continue
        assert value == resumed.last_metrics[key] or (np.isnan(value) and np.isnan(resumed.last_metrics[key])), key


def test_bc_validation_noise_does_not_depend_on_the_global_rng(demos, tmp_path):
    """Every validation draws the same timesteps and noise, so val losses compare across epochs and resumes."""
    module = BCModule(obs_dim=19, action_dim=7, horizon=4, denoising_steps=5, hidden_dims=[16, 16, 16],
                      export_safetensors=False)
    data = ChunkDataModule(str(demos), horizon=4, batch_size=8, val_fraction=0.3)
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    losses = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        losses.append(trainer.validate(module, data, verbose=False)[0]["losses/bc_val_ema"])
    assert losses[0] == losses[1]


def _dppo_cli_args(bc_checkpoint: Path, root: Path) -> list[str]:
    """`mmpo fit -c configs/robotics/dppo_lift.yaml` on Hopper (in-process envs), 12 tiny iterations,
    a checkpoint after each (one per iteration: every optimizer step count is a multiple of 1)."""
    return [
        "fit", "-c", str(REPO / "configs" / "robotics" / "dppo_lift.yaml"),
        "--model.init_args.bc_checkpoint", str(bc_checkpoint), "--model.init_args.env.task", "hopper",
        "--model.init_args.num_iterations", "12", "--model.init_args.env.num_envs", "2", "--model.init_args.env.n_steps", "3",
        "--model.init_args.env.max_episode_steps", "8", "--model.init_args.chain.ft_steps", "2",
        "--model.init_args.optim.minibatch_size", "6", "--model.init_args.optim.mu", "1",
        "--model.init_args.critic.warmup_iterations", "1", "--model.init_args.evaluation.every", "3",
        "--model.init_args.evaluation.episodes", "2", "--model.init_args.critic.hidden_dims", "[8]",
        "--model.init_args.env.asynchronous", "false",
        "--trainer.default_root_dir", str(root), "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.callbacks.init_args.dirpath", str(root / "checkpoints"),
        "--trainer.callbacks.init_args.filename", "{step}", "--trainer.callbacks.init_args.every_n_train_steps", "1",
    ]


@pytest.mark.slow
def test_dppo_fit_killed_with_sigkill_resumes_bit_exactly(tmp_path):
    from mmpo.cli import main

    torch.manual_seed(0)
    bc = BCModule(obs_dim=11, action_dim=3, horizon=2, act_steps=2, denoising_steps=3, hidden_dims=[8, 8, 8],
                  export_safetensors=False, task="hopper")
    bc_checkpoint = tmp_path / "bc.ckpt"
    torch.save({"state_dict": bc.state_dict(), "robotics": bc.robotics_metadata()}, bc_checkpoint)
    killed = tmp_path / "killed" / "checkpoints"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen([sys.executable, "-m", "mmpo.cli", *_dppo_cli_args(bc_checkpoint, tmp_path / "killed")],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while len(list(killed.glob("step=*.ckpt"))) < 3 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    _, stderr = process.communicate()
    assert process.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    written = sorted(killed.glob("step=*.ckpt"), key=lambda path: int(path.stem.split("=")[1]))
    resume_from = written[-2]  # the newest may have been cut mid-write
    iteration = torch.load(resume_from, weights_only=True)["dppo_state"]["iteration"]
    assert 1 <= iteration < 12

    main([*_dppo_cli_args(bc_checkpoint, tmp_path / "resumed"), "--ckpt_path", str(resume_from)])
    main(_dppo_cli_args(bc_checkpoint, tmp_path / "uninterrupted"))
    expected = training_state(tmp_path / "uninterrupted" / "checkpoints" / "last.ckpt")
    actual = training_state(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert expected["dppo_state"]["iteration"] == 12
    assert assert_same_tensors(expected, actual) > len(expected["state_dict"])


@pytest.mark.slow
def test_dppo_fit_with_env_workers_killed_leaves_no_workers_and_resumes_bit_exactly(tmp_path):
    """A long run's real setting: envs in worker processes (``asynchronous: true``). SIGKILL of the trainer
    mid-run must not leave env workers (or their forkserver) running, and the resumed run (new workers, envs
    reset at its first iteration) ends equal to an uninterrupted one."""
    import psutil

    from mmpo.cli import main

    torch.manual_seed(0)
    bc = BCModule(obs_dim=11, action_dim=3, horizon=2, act_steps=2, denoising_steps=3, hidden_dims=[8, 8, 8],
                  export_safetensors=False, task="hopper")
    bc_checkpoint = tmp_path / "bc.ckpt"
    torch.save({"state_dict": bc.state_dict(), "robotics": bc.robotics_metadata()}, bc_checkpoint)
    workers = ["--model.init_args.env.asynchronous", "true"]
    killed = tmp_path / "killed" / "checkpoints"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen([sys.executable, "-m", "mmpo.cli", *_dppo_cli_args(bc_checkpoint, tmp_path / "killed"),
                                *workers], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while len(list(killed.glob("step=*.ckpt"))) < 3 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    children = psutil.Process(process.pid).children(recursive=True)
    assert len(children) >= 2, children  # the env workers (and the forkserver they are forked from)
    os.kill(process.pid, signal.SIGKILL)
    _, stderr = process.communicate()
    assert process.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"env worker processes outlived the killed run: {alive}"
    written = sorted(killed.glob("step=*.ckpt"), key=lambda path: int(path.stem.split("=")[1]))
    resume_from = written[-2]  # the newest may have been cut mid-write
    assert 1 <= torch.load(resume_from, weights_only=True)["dppo_state"]["iteration"] < 12

    main([*_dppo_cli_args(bc_checkpoint, tmp_path / "resumed"), *workers, "--ckpt_path", str(resume_from)])
    main([*_dppo_cli_args(bc_checkpoint, tmp_path / "uninterrupted"), *workers])
    expected = training_state(tmp_path / "uninterrupted" / "checkpoints" / "last.ckpt")
    actual = training_state(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert expected["dppo_state"]["iteration"] == 12
    assert assert_same_tensors(expected, actual) > len(expected["state_dict"])
