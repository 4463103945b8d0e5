"""A DPPO env worker killed with SIGKILL is restarted and counted; beyond the limit the error names it."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from mmpo.robotics.envs import make_vector_env
from mmpo.robotics.envs.workers import EnvWorkerError


def _kill(envs, index: int) -> None:
    process = envs.processes[index]
    os.kill(process.pid, signal.SIGKILL)
    process.join(timeout=10)
    assert process.exitcode == -signal.SIGKILL


def test_killed_worker_is_restarted_counted_and_its_episode_ends_as_a_fault():
    envs = make_vector_env("hopper", 2, seed=4, act_steps=2, max_worker_restarts=1)
    try:
        first_obs, _ = envs.reset(seed=4)
        actions = np.zeros((2, 2, 3))
        envs.step(actions)
        _kill(envs, 1)  # between two steps: the next step's send finds a broken pipe
        obs, rewards, terminated, truncated, infos = envs.step(actions)
        assert envs.worker_restarts == 1
        assert terminated.tolist() == [False, True] and not truncated.any()
        assert rewards[1] == 0.0 and rewards[0] != 0.0
        assert infos["_final_info"].tolist() == [False, True]
        assert infos["final_info"]["fault"][1] and infos["final_info"]["worker_restarted"][1]
        # the new worker rebuilt env 1 from its factory: its first reset uses seed 4 + 1 again
        np.testing.assert_array_equal(obs[1], first_obs[1])
        assert envs.processes[1].is_alive()
        envs.step(actions)  # the run goes on
        # a worker found dead when a reset is sent is restarted too (here: beyond the limit). Killed before
        # the send, not after: a worker that answered before its kill would leave a good reply in the pipe.
        _kill(envs, 0)
        envs.reset_async(seed=4)
        with pytest.raises(EnvWorkerError, match=r"env worker 0 \(hopper, seed 4, pid \d+\) died \(exit code -9\) "
                                                 r"during 'reset'; 1 worker restart\(s\) already, the limit is "
                                                 r"max_worker_restarts=1"):
            envs.reset_wait()
    finally:
        envs.close(terminate=True)


def test_reset_after_a_worker_death_is_exactly_the_requested_reset():
    envs = make_vector_env("hopper", 2, seed=0, act_steps=2, max_worker_restarts=2)
    try:
        expected, _ = envs.reset(seed=11)
        _kill(envs, 0)
        obs, _ = envs.reset(seed=11)
        np.testing.assert_array_equal(obs, expected)
        assert envs.worker_restarts == 1
    finally:
        envs.close(terminate=True)


def test_dppo_run_survives_a_killed_worker_and_logs_the_restart(tmp_path):
    import lightning.pytorch as pl

    from mmpo.robotics.dppo import DPPOModule
    from mmpo.robotics.policy import DiffusionPolicy
    from mmpo.robotics.policy.io import save_policy_safetensors

    policy = DiffusionPolicy(11, 3, 2, denoising_steps=3, hidden_dims=[8, 8, 8])  # Hopper: obs 11, action 3
    checkpoint = save_policy_safetensors(policy, {"kind": "bc", "task": "hopper", "act_steps": 2},
                                         tmp_path / "policy.safetensors")
    module = DPPOModule(str(checkpoint), num_iterations=2,
                        env={"num_envs": 2, "n_steps": 3, "max_episode_steps": 20, "max_worker_restarts": 1},
                        chain={"ft_steps": 2}, optim={"minibatch_size": 12, "mu": 1}, evaluation={"every": 0},
                        critic={"hidden_dims": [8]})

    class KillWorkerAfterFirstIteration(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            if pl_module.iteration == 1:
                assert pl_module.last_metrics["perf/env_worker_restarts"] == 0.0
                _kill(pl_module.envs, 1)

    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[KillWorkerAfterFirstIteration()],
                         default_root_dir=tmp_path)
    trainer.fit(module)
    assert module.iteration == 2
    assert module.last_metrics["perf/env_worker_restarts"] == 1.0
