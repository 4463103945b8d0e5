"""STL tasks for TGPO (mmpo/robotics/tgpo.py): a 2-D point mass and a MuJoCo two-link arm (gymnasium Reacher-v5),
each with nested specifications of 2 to 4 sequential timed reach subgoals plus an obstacle to avoid.

Observation (flat float32): ``[state (D), t / H, stage one-hot (K + 1), tau / H (K)]`` -- the policy and the
critic see the state, the time, the stage (subgoals already due) and the time allocation tau (K integer steps,
the last K entries, set through the vector env with ``set_attr("tgpo_tau", rows)`` before a reset). The reward is
TGPO's dense stage-wise reward (:func:`mmpo.robotics.tgpo_core.stage_reward`) plus ``success_bonus`` on the last step
when the whole formula is satisfied. The last step of an episode (t = H)
puts the whole formula's robustness on the recorded trajectory in ``info["stl_robustness"]`` and
``info["success"] = robustness > 0``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from mmpo.robotics.stl import Always, And, Eventually, Formula, InBall, Not
from mmpo.robotics.tgpo_core import decompose, stage_count, stage_reward

SUBGOAL_CHOICES = (2, 3, 4)
#: "stage": TGPO's stage-wise reward; "robustness": the flat baseline's, 0 until the last step, then the whole
#: formula's robustness on the episode (PPO on the STL robustness reward, no decomposition).
REWARD_MODES = ("stage", "robustness")


def nested_reach_spec(goals: list[InBall], obstacle: InBall, first: tuple[int, int], then: tuple[int, int]) -> Formula:
    """``F[first](g1 and F[then](g2 and F[then](...))) and G[0, H](not obstacle)``, H = the reach part's horizon."""
    spec: Formula | None = None
    for goal in reversed(goals):
        interval = first if goal is goals[0] else then
        body = goal if spec is None else And((goal, spec))
        spec = Eventually(body, *interval)
    assert spec is not None
    return And((spec, Always(Not(obstacle), 0, spec.horizon())))


#: the point mass's subgoal windows: (first, then) intervals; "tight" leaves little slack for the allocation (each
#: subgoal needs 4-8 steps from its predecessor at full speed, so most uniform allocations of [0, 10] are too early)
POINTMASS_WINDOWS = {"standard": ((0, 20), (5, 20)), "tight": ((0, 10), (0, 10))}


def pointmass_spec(num_subgoals: int, windows: str = "standard") -> Formula:
    """Point mass in [-1, 1]^2: visit 2-4 balls (r 0.15) in order around an obstacle (r 0.25 at (0, 0.1)), each
    within the ``POINTMASS_WINDOWS[windows]`` interval after the previous one."""
    _check_subgoals(num_subgoals)
    if windows not in POINTMASS_WINDOWS:
        raise ValueError(f"windows must be one of {sorted(POINTMASS_WINDOWS)}, got {windows!r}")
    centers = [(0.6, -0.2), (0.6, 0.6), (-0.6, 0.6), (-0.6, -0.2)][:num_subgoals]
    goals = [InBall(c, 0.15) for c in centers]
    return nested_reach_spec(goals, InBall((0.0, 0.1), 0.25), *POINTMASS_WINDOWS[windows])


#: where the Reacher task's obstacle ball sits (angle in degrees, distance from the arm's base): "arc" on the
#: goals' circle halfway between the first two goals, so the arm's direct path between them (the elbow held, the
#: shoulder turning) runs through it; "inner" at the same angle but inside the circle, off that arc and across the
#: straight (chord) path between the two goals, so some short paths avoid it and some do not
REACHER_OBSTACLES = {"arc": (105.0, 0.15), "inner": (105.0, 0.07)}


def reacher_spec(num_subgoals: int, obstacle: str = "arc") -> Formula:
    """Reacher fingertip (reach 0.21): visit 2-4 balls (r 0.04) on the circle of radius 0.15 in order, avoiding an
    obstacle ball (r 0.04) between the first two, placed by ``REACHER_OBSTACLES[obstacle]``."""
    _check_subgoals(num_subgoals)
    if obstacle not in REACHER_OBSTACLES:
        raise ValueError(f"obstacle must be one of {sorted(REACHER_OBSTACLES)}, got {obstacle!r}")
    angles = np.deg2rad([60.0, 150.0, 240.0, 330.0][:num_subgoals])
    goals = [InBall((0.15 * float(np.cos(a)), 0.15 * float(np.sin(a))), 0.04) for a in angles]
    degrees, distance = REACHER_OBSTACLES[obstacle]
    mid = np.deg2rad(degrees)
    center = (distance * float(np.cos(mid)), distance * float(np.sin(mid)))
    return nested_reach_spec(goals, InBall(center, 0.04), (0, 30), (5, 30))


def _check_subgoals(num_subgoals: int) -> None:
    if num_subgoals not in SUBGOAL_CHOICES:
        raise ValueError(f"num_subgoals must be one of {SUBGOAL_CHOICES}, got {num_subgoals}")


class STLEnv(gym.Env, ABC):
    """An STL task on a dynamical system (subclasses: ``state_dim``, ``action_dim``, :meth:`_reset_state`,
    :meth:`_step_state`). Episodes last H = the decomposition's horizon steps."""

    metadata: dict[str, Any] = {"render_modes": []}
    state_dim: int
    action_dim: int

    def __init__(self, spec: Formula, *, bonus: float = 1.0, invariant_weight: float = 1.0,
                 success_bonus: float = 1.0, reward: str = "stage", distance_scale: float = 1.0) -> None:
        if reward not in REWARD_MODES:
            raise ValueError(f"reward must be one of {REWARD_MODES}, got {reward!r}")
        if not distance_scale > 0:
            raise ValueError(f"distance_scale must be > 0, got {distance_scale}")
        self.reward_mode = reward
        self.formula = spec
        self.decomposition = decompose(spec)
        self.num_subgoals = self.decomposition.num_subgoals
        self.horizon = max(self.decomposition.horizon(), spec.horizon())
        self.bonus, self.invariant_weight = float(bonus), float(invariant_weight)
        self.success_bonus = float(success_bonus)
        #: multiplies the robustness-valued reward terms (the stage reward's progress, shortfall at a subgoal's time
        #: and invariant violation; the flat baseline's terminal robustness), not the bonuses: the arm's distances
        #: are ~5x smaller than the point mass's
        self.distance_scale = float(distance_scale)
        obs_dim = self.state_dim + 1 + (self.num_subgoals + 1) + self.num_subgoals
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (obs_dim,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (self.action_dim,), np.float32)
        #: the allocation of the next episodes (set through the vector env: ``set_attr("tgpo_tau", rows)``)
        self.tgpo_tau = self.decomposition.midpoints(1)[0].numpy()
        self._traj: list[np.ndarray] = []
        self._tau = torch.as_tensor(self.tgpo_tau).view(1, -1)

    @abstractmethod
    def _reset_state(self, seed: int | None) -> np.ndarray:
        """The initial state (D,) drawn from ``self.np_random``."""

    @abstractmethod
    def _step_state(self, action: np.ndarray) -> np.ndarray:
        """The next state (D,) after ``action`` (clipped to [-1, 1]) from ``self._traj[-1]``."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        tau = torch.as_tensor(np.asarray(self.tgpo_tau, dtype=np.int64)).view(1, -1)
        if tau.shape[1] != self.num_subgoals or not bool(self.decomposition.feasible(tau)[0]):
            raise ValueError(f"tgpo_tau {tau.tolist()[0]} is not a feasible allocation of {self.num_subgoals} subgoals")
        self._tau = tau
        self._t = 0
        self._traj = [np.asarray(self._reset_state(seed), dtype=np.float64)]
        return self._obs(), {"stl_robustness": float("nan")}

    def _obs(self) -> np.ndarray:
        stage = np.zeros(self.num_subgoals + 1, np.float32)
        stage[int(stage_count(self._tau, self._t)[0])] = 1.0
        tau = self._tau[0].numpy().astype(np.float32) / self.horizon
        parts = [self._traj[-1].astype(np.float32), [self._t / self.horizon], stage, tau]
        return np.concatenate(parts).astype(np.float32)

    def step(self, action):
        prev = self._traj[-1]
        state = np.asarray(self._step_state(np.clip(np.asarray(action, np.float64), -1.0, 1.0)), dtype=np.float64)
        self._traj.append(state)
        self._t += 1
        done = self._t >= self.horizon
        info: dict[str, Any] = {"stl_robustness": float("nan"), "success": False}
        if done:
            rho = float(self.formula(torch.as_tensor(np.stack(self._traj)).unsqueeze(0))[0])
            info.update(stl_robustness=rho, success=rho > 0)
        if self.reward_mode == "robustness":
            return self._obs(), self.distance_scale * info["stl_robustness"] if done else 0.0, False, done, info
        # scale * stage_reward(bonus / scale) = scale * (robustness terms) + bonus * 1[subgoal met at its time]
        scale = self.distance_scale
        reward = stage_reward(self.decomposition, torch.as_tensor(prev).view(1, -1), torch.as_tensor(state).view(1, -1),
                              self._t, self._tau, bonus=self.bonus / scale, invariant_weight=self.invariant_weight)
        return self._obs(), scale * float(reward[0]) + (self.success_bonus if info["success"] else 0.0), False, done, info


class STLPointMassEnv(STLEnv):
    """2-D single integrator: x' = clip(x + 0.1 a, -1, 1); start uniform in [-0.2, 0.2] x [-0.9, -0.7]."""

    state_dim, action_dim = 2, 2

    def __init__(self, num_subgoals: int = 2, windows: str = "standard", **kwargs: Any) -> None:
        super().__init__(pointmass_spec(num_subgoals, windows), **kwargs)

    def _reset_state(self, seed: int | None) -> np.ndarray:
        return np.array([self.np_random.uniform(-0.2, 0.2), self.np_random.uniform(-0.9, -0.7)])

    def _step_state(self, action: np.ndarray) -> np.ndarray:
        return np.clip(self._traj[-1] + 0.1 * action, -1.0, 1.0)


class STLReacherEnv(STLEnv):
    """gymnasium's MuJoCo Reacher-v5 (two-link arm, torques in [-1, 1]); state = fingertip (x, y), cos and sin of
    both joint angles, both joint velocities (8-D). Reacher's own target and reward are not used."""

    state_dim, action_dim = 8, 2

    def __init__(self, num_subgoals: int = 2, obstacle: str = "arc", **kwargs: Any) -> None:
        self._arm = gym.make("Reacher-v5", max_episode_steps=None, disable_env_checker=True).unwrapped
        super().__init__(reacher_spec(num_subgoals, obstacle), **kwargs)

    def _arm_state(self) -> np.ndarray:
        arm = self._arm
        q, qd = arm.data.qpos[:2], arm.data.qvel[:2]
        tip = arm.get_body_com("fingertip")[:2]
        return np.concatenate([tip, np.cos(q), np.sin(q), qd]).astype(np.float64)

    def _reset_state(self, seed: int | None) -> np.ndarray:
        self._arm.reset(seed=int(self.np_random.integers(2**31)))
        return self._arm_state()

    def _step_state(self, action: np.ndarray) -> np.ndarray:
        self._arm.do_simulation(action, self._arm.frame_skip)
        return self._arm_state()

    def close(self) -> None:
        self._arm.close()
