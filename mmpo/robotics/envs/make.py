"""``make_env``: one task instance, fault-guarded and time-limited."""

from __future__ import annotations

import gymnasium as gym

from mmpo.robotics.envs.faults import SimulatorFaultWrapper
from mmpo.robotics.envs.robosuite_env import RobosuiteGymEnv, ensure_offscreen_gl
from mmpo.robotics.envs.tasks import get_task


def make_env(
    task: str,
    *,
    seed: int | None = None,
    max_episode_steps: int | None = None,
    render: bool = False,
    camera: str | None = None,
    image_size: int = 84,
    terminate_on_success: bool = False,
) -> gym.Env:
    """Build one environment: ``[SeedFirstReset](TimeLimit(SimulatorFaultWrapper(task env)))``.

    Args:
        task: "lift", "can", "square" (robosuite, robomimic setup) or "hopper" (gymnasium Hopper-v5).
        seed: seeds the first ``reset()`` (object placement / initial state); later resets
            continue the same random stream. Pass ``seed`` to ``reset`` to re-seed.
        max_episode_steps: time limit in env steps (default: the task's, 300 for lift/can,
            1000 for hopper); reaching it gives ``truncated=True``.
        render: enable offscreen rendering; ``env.render()`` then returns an
            (image_size, image_size, 3) uint8 frame (robosuite: its default ``frontview`` camera).
        camera: robosuite camera name (e.g. "agentview", "robot0_eye_in_hand") to add an
            image to the observation (obs becomes Dict(state, image)); robosuite tasks only.
        image_size: side of camera observations and of ``render()`` frames.
        terminate_on_success: end robosuite episodes at the first success (robomimic/DPPO
            default False: episodes run to the time limit; True makes evaluation cheaper).

    Returns:
        gymnasium.Env with flat float32 observations (obs_dim,) and actions (action_dim,).
        robosuite tasks put ``info["success"]`` (bool) on every step; every task puts
        ``info["fault"]`` on every step.
    """
    spec = get_task(task)
    limit = int(max_episode_steps or spec.max_episode_steps)
    if limit < 1:
        raise ValueError(f"max_episode_steps must be >= 1, got {max_episode_steps}")
    if spec.family == "robosuite":
        base: gym.Env = RobosuiteGymEnv(
            spec,
            max_episode_steps=limit,
            render=render,
            camera=camera,
            image_size=image_size,
            terminate_on_success=terminate_on_success,
            seed=seed,
        )
    else:
        if camera is not None:
            raise ValueError(f"camera observations are only supported for robosuite tasks, not {task!r}")
        if render:
            ensure_offscreen_gl()
        kwargs = {"render_mode": "rgb_array", "width": image_size, "height": image_size} if render else {}
        # gym.make's own TimeLimit is disabled: ours goes outside the fault guard.
        base = gym.make(spec.sim_name, max_episode_steps=None, disable_env_checker=True, **kwargs)
        base = _StripTimeLimit.unwrap(base)
    env = gym.wrappers.TimeLimit(SimulatorFaultWrapper(base), max_episode_steps=limit)
    if seed is not None:
        env = SeedFirstReset(env, seed)
    return env


class _StripTimeLimit:
    """gym.make always adds a TimeLimit from the registry's spec; drop it (ours is outside)."""

    @staticmethod
    def unwrap(env: gym.Env) -> gym.Env:
        if isinstance(env, gym.wrappers.TimeLimit):
            return env.env
        return env


class SeedFirstReset(gym.Wrapper):
    """Use ``seed`` at the first reset() that passes none (gymnasium's seeding convention:
    seed once, later resets continue the same random stream)."""

    def __init__(self, env: gym.Env, seed: int) -> None:
        super().__init__(env)
        self._pending_seed: int | None = int(seed)

    def reset(self, *, seed: int | None = None, options=None):
        if seed is None:
            seed = self._pending_seed
        self._pending_seed = None
        return self.env.reset(seed=seed, options=options)
