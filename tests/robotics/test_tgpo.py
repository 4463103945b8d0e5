"""TGPO's STL envs and module (mmpo/robotics/envs/stl_envs.py, mmpo/robotics/tgpo.py): observation layout, a
scripted policy that satisfies the spec, allocations reaching the envs, `mmpo fit` of both configs and exact resume."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from mmpo.robotics.envs.make import make_env
from mmpo.robotics.tgpo import TGPOModule
from mmpo.robotics.tgpo_core import current_subgoal, stage_reward
from reliability.test_resume_robotics import assert_same_tensors, training_state

REPO = Path(__file__).resolve().parents[2]
TINY = {"tgpo": {"hidden_dims": [8, 8, 8]}, "critic": {"hidden_dims": [8, 8, 8], "warmup_iterations": 0},
        "optim": {"minibatch_size": 40, "mu": 1}, "evaluation": {"every": 0}}


def _scripted_episode(env, tau):
    """Fly at full speed toward the subgoal being pursued (the pending one due first), then hold."""
    inner = env.unwrapped
    inner.tgpo_tau = np.asarray(tau)
    obs, _ = env.reset(seed=3)
    rewards, states, done, t = [], [inner._traj[-1].copy()], False, 0
    while not done:
        goal = int(current_subgoal(torch.tensor([tau]), t + 1)[0])
        target = np.array(inner.decomposition.subgoals[max(goal, 0)].reach.center)
        obs, reward, terminated, truncated, info = env.step(np.clip((target - states[-1]) / 0.1, -1, 1))
        rewards.append(reward)
        states.append(inner._traj[-1].copy())
        done, t = terminated or truncated, t + 1
    return obs, rewards, np.stack(states), info


def test_pointmass_observation_and_a_satisfying_scripted_run():
    env = make_env("stl_pointmass2", seed=0)
    inner = env.unwrapped
    assert inner.horizon == 40 and env.observation_space.shape == (8,)
    inner.tgpo_tau = np.array([15, 30])
    obs, _ = env.reset(seed=3)
    # [x, y, t / H, stage one-hot (3), tau / H]
    assert obs[2:].tolist() == pytest.approx([0.0, 1.0, 0.0, 0.0, 15 / 40, 30 / 40])
    assert -0.2 <= obs[0] <= 0.2 and -0.9 <= obs[1] <= -0.7
    last, rewards, states, info = _scripted_episode(env, [15, 30])
    assert len(rewards) == 40 and last[2:6].tolist() == pytest.approx([1.0, 0.0, 0.0, 1.0])  # t = H, stage 2
    assert info["success"] and info["stl_robustness"] > 0
    expected = inner.formula(torch.as_tensor(states).unsqueeze(0)).item()
    assert info["stl_robustness"] == pytest.approx(expected)
    tau = torch.tensor([[15, 30]])
    by_hand = [stage_reward(inner.decomposition, torch.as_tensor(states[t - 1]).view(1, -1),
                            torch.as_tensor(states[t]).view(1, -1), t, tau).item() for t in range(1, 41)]
    by_hand[-1] += 1.0  # success_bonus: the formula holds
    assert rewards == pytest.approx(by_hand) and sum(rewards) > 3.0  # both subgoals met at their times
    # an allocation too early for the first subgoal (due at t=2, ~9 steps away) forfeits its bonus: the STL
    # spec itself does not pin the times (this path still passes through the first ball and satisfies it)
    _, early_rewards, _, early = _scripted_episode(env, [2, 20])
    assert sum(early_rewards) < sum(rewards) - 0.5 and early["success"]
    inner.tgpo_tau = np.array([30, 31])  # 31 < 30 + 5: infeasible
    with pytest.raises(ValueError, match="not a feasible allocation"):
        env.reset(seed=0)


def test_tight_pointmass_task():
    env = make_env("stl_pointmass2_tight", seed=0)
    inner = env.unwrapped
    assert inner.horizon == 20 and env.observation_space.shape == (8,)
    # the first subgoal is ~5 full-speed steps away, the second ~5-7 after it: [7, 14] is met, [2, 4] is too early
    _, rewards, _, info = _scripted_episode(env, [7, 14])
    _, early_rewards, _, early = _scripted_episode(env, [2, 4])
    assert info["success"] and not early["success"] and sum(early_rewards) < sum(rewards) - 1.0


def test_flat_baseline_reward_is_the_terminal_robustness():
    stage, flat = make_env("stl_pointmass2", seed=0), make_env("stl_pointmass2_robustness", seed=0)
    _, stage_rewards, stage_states, stage_info = _scripted_episode(stage, [15, 30])
    _, flat_rewards, flat_states, flat_info = _scripted_episode(flat, [15, 30])
    assert np.array_equal(stage_states, flat_states) and flat_info["success"]
    assert flat_rewards[:-1] == [0.0] * 39 and flat_rewards[-1] == flat_info["stl_robustness"] > 0
    assert flat_info["stl_robustness"] == stage_info["stl_robustness"]
    with pytest.raises(ValueError, match="reward must be one of"):
        type(stage.unwrapped)(2, reward="sparse")


def test_reacher_env_is_the_mujoco_arm():
    env = make_env("stl_reacher3", seed=0)
    obs, _ = env.reset(seed=1)
    assert obs.shape == (16,) and env.unwrapped.horizon == 90
    tip = obs[:2]
    assert 0.05 < np.linalg.norm(tip) <= 0.211  # fingertip within the arm's reach
    obs2, _, _, _, _ = env.step(np.ones(2, np.float32))
    assert not np.allclose(obs2[6:8], 0.0)  # joint velocities respond to the torques
    env.close()


def _polar(r, degrees):
    return [r * np.cos(np.deg2rad(degrees)), r * np.sin(np.deg2rad(degrees))] + [0.0] * 6


@pytest.mark.parametrize("obstacle, via, expected", [
    # fingertip at r 0.16 on g1's ray (g1 margin 0.04 - 0.01) for t <= 10, then 5 steps at the midpoint of a path,
    # then on g2 (margin 0.04) from t = 16: F[0,30](g1 and F[5,30] g2) holds with 0.03 at t = 10 (g2 at 16..40)
    ("inner", "arc", 0.03),  # arc midpoint (r 0.15, 105 deg) is 0.08 from the inner obstacle: 0.08 - 0.04 > 0.03
    ("inner", "chord", 0.15 * np.cos(np.pi / 4) - 0.07 - 0.04),  # chord midpoint r 0.15 cos 45 deg: -0.0039
    ("arc", "arc", -0.04),  # the arc midpoint is the arc obstacle's centre
    ("arc", "chord", (0.15 - 0.15 * np.cos(np.pi / 4)) - 0.04),  # +0.0039: the chord just clears the obstacle
])
def test_reacher_obstacle_placements_by_hand(obstacle, via, expected):
    from mmpo.robotics.envs.stl_envs import reacher_spec

    mid = _polar(0.15, 105.0) if via == "arc" else _polar(0.15 * np.cos(np.pi / 4), 105.0)
    traj = [_polar(0.16, 60.0)] * 11 + [mid] * 5 + [_polar(0.15, 150.0)] * 45
    rho = reacher_spec(2, obstacle)(torch.tensor([traj], dtype=torch.float64))
    assert rho.shape == (1,) and float(rho[0]) == pytest.approx(expected, abs=1e-9)
    with pytest.raises(ValueError, match="obstacle must be one of"):
        reacher_spec(2, "centre")


def test_reacher_inner_task_scales_the_robustness_terms_not_the_bonuses():
    from mmpo.robotics.envs.stl_envs import STLReacherEnv

    plain = STLReacherEnv(2, obstacle="inner")  # distance_scale 1
    scaled = make_env("stl_reacher2_inner", seed=0).unwrapped  # the registered task: distance_scale 5
    flat = make_env("stl_reacher2_inner_robustness", seed=0).unwrapped
    assert (scaled.distance_scale, flat.distance_scale, scaled.horizon) == (5.0, 5.0, 60)
    assert scaled.formula == plain.formula == flat.formula
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, (60, 2))
    runs = []
    for env in (plain, scaled, flat):
        env.reset(seed=3)
        runs.append([env.step(a)[1:] for a in actions])
    (r1, r5, rf) = ([step[0] for step in run] for run in runs)
    tau = plain.tgpo_tau.tolist()  # the midpoint allocation (15, 32) on both
    met = [bool(plain.decomposition.subgoals[k].reach(torch.tensor(plain._traj[t]).view(1, 1, -1))[0] > 0)
           for k, t in enumerate(tau)]
    bonus = np.zeros(60)
    bonus[[t - 1 for t in tau]] = met  # rewards[i] is the step reaching t = i + 1
    assert np.allclose(np.array(r5) - bonus, 5 * (np.array(r1) - bonus), atol=1e-9)
    rho = runs[2][-1][3]["stl_robustness"]
    assert rf[:-1] == [0.0] * 59 and rf[-1] == pytest.approx(5 * rho) and not runs[2][-1][3]["success"]
    with pytest.raises(ValueError, match="distance_scale must be > 0"):
        STLReacherEnv(2, distance_scale=0.0)
    for env in (plain, scaled, flat):
        env.close()


def _module(tmp_path=None, **overrides):
    settings = {**TINY, "env": {"task": "stl_pointmass2", "num_envs": 4, "n_steps": 40, "act_steps": 1,
                                "asynchronous": False}, **overrides}
    return TGPOModule(num_iterations=2, **settings)


def test_allocations_reach_the_envs_and_the_chains_are_feasible(tmp_path):
    module = _module()
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         accelerator="cpu", default_root_dir=tmp_path)
    trainer.fit(module)
    module.envs = module.make_envs()
    try:
        module._reset_envs()
        tau = module.allocator.tau
        assert module.decomposition.feasible(tau).all()
        assert np.array_equal(np.stack(module.envs.get_attr("tgpo_tau")), tau.numpy())
        assert np.allclose(module._obs[:, -2:], tau.numpy() / 40)  # the second reset shows the chains' tau
        assert module.allocator.proposed == 3 * 4  # one MH step per env at each of the 3 resets
        # evaluation: each env's allocation is the best of the candidates by V(s0, tau)
        obs0 = torch.as_tensor(module.envs.reset(seed=5)[0])
        best = module.evaluation_allocations(obs0, 5)
        candidates = [module.decomposition.uniform(4, g) for g in [torch.Generator().manual_seed(5)] for _ in range(16)]
        values = torch.stack([module.initial_values(obs0, c) for c in candidates])
        assert torch.equal(module.initial_values(obs0, best), values.amax(0))
    finally:
        module.teardown("fit")


@pytest.mark.slow
def test_allocations_reach_subprocess_env_workers_in_groups():
    """The same vector-env workers as DPPO (subprocesses, two groups): set_attr reaches every env."""
    module = _module(env={"task": "stl_pointmass2", "num_envs": 3, "n_steps": 40, "act_steps": 1,
                          "asynchronous": True, "env_groups": 2})
    module.envs = module.make_envs()
    try:
        assert type(module.envs).__name__ == "EnvGroups"
        module._reset_envs()
        tau = module.allocator.tau
        assert np.array_equal(np.stack(module.envs.get_attr("tgpo_tau")), tau.numpy())
        assert np.allclose(module._obs[:, -2:], tau.numpy() / 40)
        with pytest.raises(ValueError, match="needs 3 values"):
            module.envs.set_attr("tgpo_tau", [tau[0].numpy()])
    finally:
        module.teardown("fit")


def test_uniform_sampler_and_bad_settings():
    module = _module(tgpo={"hidden_dims": [8, 8, 8], "sampler": "uniform"})
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         accelerator="cpu")
    trainer.fit(module)
    assert module.allocator.proposed == 0 and module.last_metrics["charts/episodes"] == 4.0
    with pytest.raises(ValueError, match="must equal the task's horizon 40"):
        _module(env={"task": "stl_pointmass2", "num_envs": 2, "n_steps": 30, "act_steps": 1, "asynchronous": False})
    with pytest.raises(ValueError, match="not an STL task"):
        _module(env={"task": "hopper", "num_envs": 2, "n_steps": 30, "act_steps": 1, "asynchronous": False})
    with pytest.raises(ValueError, match="sampler must be one of"):
        _module(tgpo={"sampler": "grid"})


def _cli_args(config: str, root: Path, *extra: str) -> list[str]:
    return ["fit", "-c", str(REPO / "configs" / "robotics" / config), "--trainer.default_root_dir", str(root),
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks.init_args.dirpath", str(root / "checkpoints"),
            "--trainer.callbacks.init_args.filename", "{step}",
            "--trainer.callbacks.init_args.every_n_train_steps", "1",
            "--model.init_args.tgpo.hidden_dims", "[8, 8, 8]", "--model.init_args.critic.hidden_dims", "[8, 8, 8]",
            "--model.init_args.optim.mu", "1", *extra]


def test_mmpo_fit_both_configs_and_tgpo_resumes_exactly(tmp_path):
    from mmpo.cli import main

    reacher = ["--model.init_args.num_iterations", "2", "--model.init_args.env.num_envs", "2",
               "--model.init_args.optim.minibatch_size", "60", "--model.init_args.evaluation.every", "1",
               "--model.init_args.evaluation.episodes", "2"]
    main(_cli_args("tgpo_reacher.yaml", tmp_path / "reacher", *reacher))
    ckpt = torch.load(tmp_path / "reacher" / "checkpoints" / "last.ckpt", weights_only=True)
    # 2 iterations x 2 minibatches (2 envs x 60 steps / 60) x 2 optimizers
    assert ckpt["global_step"] == 8 and ckpt["dppo_state"]["iteration"] == 2
    assert ckpt["robotics"]["kind"] == "tgpo" and ckpt["tgpo_state"]["proposed"] == 4

    point = ["--model.init_args.num_iterations", "3", "--model.init_args.env.num_envs", "2",
             "--model.init_args.optim.minibatch_size", "40", "--model.init_args.evaluation.every", "2",
             "--model.init_args.evaluation.episodes", "2"]
    main(_cli_args("tgpo_pointmass.yaml", tmp_path / "full", *point))
    full = tmp_path / "full" / "checkpoints"
    # per iteration: 2 minibatches (2 envs x 40 steps / 40) x 2 optimizers = 4 steps
    first = full / "step=4.ckpt"
    assert torch.load(first, weights_only=True)["dppo_state"]["iteration"] == 1
    main(_cli_args("tgpo_pointmass.yaml", tmp_path / "resumed", *point, "--ckpt_path", str(first)))
    expected = training_state(full / "last.ckpt")
    actual = training_state(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert expected["dppo_state"]["iteration"] == 3 and expected["global_step"] == 12
    assert assert_same_tensors(expected, actual) > len(expected["state_dict"])
    expected_chains = torch.load(full / "last.ckpt", weights_only=True)["tgpo_state"]
    actual_chains = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)["tgpo_state"]
    assert_same_tensors(expected_chains, actual_chains, "tgpo_state")
    assert expected_chains["proposed"] == 3 * 2
