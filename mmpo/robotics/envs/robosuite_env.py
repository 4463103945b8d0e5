"""robosuite task as a gymnasium.Env with robomimic's low-dim observation.

robosuite ships a ``GymWrapper``, but it concatenates *all* active observables and
exposes no per-key dict, robomimic ``states`` or success flag; we need exactly
robomimic's keys in a fixed order, the raw obs dict (for HDF5 writing), the
flattened MuJoCo state and ``info["success"]``, so this thin adapter is ours.
"""

from __future__ import annotations

import os
from typing import Any

import gymnasium as gym
import numpy as np

from mmpo.robotics.envs.robosuite_compat import apply_robosuite_compat
from mmpo.robotics.envs.tasks import TaskSpec, robosuite_env_kwargs

DEFAULT_RENDER_CAMERA = "frontview"  # robosuite.make's default render_camera: the whole arm and table in view


def ensure_offscreen_gl() -> str:
    """Pick a headless OpenGL backend for MuJoCo when the user set none.

    Checked on the 2-core dev machine: ``egl`` works (Mesa's software EGL, no GPU needed);
    ``osmesa`` fails there (no libOSMesa). An explicit ``MUJOCO_GL`` is respected.
    Must run before ``mujoco``/robosuite create their first GL context.
    """
    os.environ.setdefault("MUJOCO_GL", "egl")
    os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
    return os.environ["MUJOCO_GL"]


def _offscreen_error(sim_name: str, error: Exception) -> RuntimeError:
    return RuntimeError(
        f"offscreen rendering failed for {sim_name} (MUJOCO_GL={os.environ.get('MUJOCO_GL')!r}): {error}. "
        "Install EGL (libegl1 with Mesa or an NVIDIA driver) and use MUJOCO_GL=egl, or OSMesa "
        "(libosmesa6) with MUJOCO_GL=osmesa."
    )


def flatten_obs(obs: dict[str, np.ndarray], keys: tuple[str, ...], dtype=np.float32) -> np.ndarray:
    """Concatenate ``obs[k]`` for ``k in keys`` -> (obs_dim,) ``dtype``.

    Works on robosuite dicts (robomimic's ``object`` is robosuite's ``object-state``) and on
    robomimic-style dicts alike.
    """
    parts = []
    for key in keys:
        source = "object-state" if key == "object" and key not in obs else key
        if source not in obs:
            raise KeyError(f"observation key {key!r} missing; available: {sorted(obs)}")
        parts.append(np.asarray(obs[source], dtype=np.float64).ravel())
    return np.concatenate(parts).astype(dtype)


def robomimic_obs_dict(obs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """robosuite obs -> the keys robomimic stores: the low-dim robot0_* and ``object`` (float64), and camera frames
    ``<camera>_image`` (present only when robosuite renders cameras) as upright (H, W, 3) uint8."""
    out = {}
    for key, value in obs.items():
        if key == "object-state":
            out["object"] = np.asarray(value, dtype=np.float64)
        elif key.endswith("_image"):
            out[key] = upright(value)
        elif key.startswith("robot0_") and not key.endswith("proprio-state"):
            out[key] = np.asarray(value, dtype=np.float64)
    return out


def upright(frame: np.ndarray) -> np.ndarray:
    """robosuite renders upside down (OpenGL's origin is bottom-left): the frame flipped vertically, uint8."""
    return np.ascontiguousarray(np.asarray(frame, dtype=np.uint8)[::-1])


class RobosuiteGymEnv(gym.Env):
    """A robosuite manipulation task with a flat low-dim observation.

    Observation: (obs_dim,) float32 = concat of ``spec.obs_keys`` (or a Dict with
    ``state`` and ``image`` (H, W, 3) uint8 when ``camera`` is set). Action: (7,) in
    [-1, 1] = OSC_POSE delta (dx, dy, dz, dax, day, daz) + gripper (-1 open, +1 close).
    Reward: sparse, 1.0 while the task's success predicate holds. ``terminated`` is
    False unless ``terminate_on_success`` (robomimic/DPPO never terminate early).
    ``info``: ``success`` (bool). The raw robosuite obs dict of the latest step is
    :attr:`last_raw_obs` (the scripted experts and the HDF5 writer read it).
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}

    def __init__(
        self,
        spec: TaskSpec,
        *,
        max_episode_steps: int,
        render: bool = False,
        camera: str | None = None,
        image_size: int = 84,
        terminate_on_success: bool = False,
        seed: int | None = None,
    ) -> None:
        if render or camera is not None:
            ensure_offscreen_gl()
        import robosuite

        apply_robosuite_compat()
        self.task_spec = spec
        self.camera = camera
        self.image_size = int(image_size)
        self.render_enabled = bool(render)
        self.render_mode = "rgb_array" if render else None
        self.terminate_on_success = bool(terminate_on_success)
        self.env_kwargs = robosuite_env_kwargs(
            spec, max_episode_steps=max_episode_steps, render=render, camera=camera, image_size=image_size
        )
        # one control step is one rendered frame: videos play in real time at the control frequency
        self.metadata = {**type(self).metadata, "render_fps": self.env_kwargs["control_freq"]}
        try:
            self.sim_env = robosuite.make(env_name=spec.sim_name, seed=seed, **self.env_kwargs)
        except Exception as error:  # GL failures surface here when camera obs are requested
            if render or camera is not None:
                raise _offscreen_error(spec.sim_name, error) from error
            raise
        state_box = gym.spaces.Box(-np.inf, np.inf, shape=(spec.obs_dim,), dtype=np.float32)
        if camera is None:
            self.observation_space = state_box
        else:
            image_box = gym.spaces.Box(0, 255, shape=(self.image_size, self.image_size, 3), dtype=np.uint8)
            self.observation_space = gym.spaces.Dict({"state": state_box, "image": image_box})
        low, high = self.sim_env.action_spec
        self.action_space = gym.spaces.Box(
            low.astype(np.float32), high.astype(np.float32), dtype=np.float32
        )
        self.last_raw_obs: dict[str, np.ndarray] = {}

    # --- helpers -----------------------------------------------------------------
    def _convert(self, raw: dict[str, np.ndarray]):
        self.last_raw_obs = raw
        spec = self.task_spec
        if spec.camera is not None:  # a camera task: its upright frame is part of the flat observation
            raw = {**raw, f"{spec.camera}_image": upright(raw[f"{spec.camera}_image"])}
        state = flatten_obs(raw, spec.obs_keys)
        if self.camera is None:
            return state
        return {"state": state, "image": upright(raw[f"{self.camera}_image"])}

    def get_sim_state(self) -> np.ndarray:
        """Flattened MuJoCo state (time, qpos, qvel) — what robomimic stores as ``states``."""
        return np.asarray(self.sim_env.sim.get_state().flatten(), dtype=np.float64)

    def is_success(self) -> bool:
        return bool(self.sim_env._check_success())

    def _reseed(self, seed: int) -> None:
        # robosuite draws robot init noise from env.rng and object placements from the
        # placement sampler's own reference to the rng given at construction (composite
        # samplers hold one per child), so all of them get the new generator.
        rng = np.random.default_rng(seed)
        self.sim_env.rng = rng
        pending = [getattr(self.sim_env, "placement_initializer", None)]
        while pending:
            sampler = pending.pop()
            if sampler is None:
                continue
            sampler.rng = rng
            pending.extend(getattr(sampler, "samplers", {}).values())

    # --- gymnasium API -------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        if seed is not None:
            self._reseed(seed)
        raw = self.sim_env.reset()
        return self._convert(raw), {"success": self.is_success()}

    def step(self, action):
        action = np.asarray(action, dtype=np.float64).reshape(self.action_space.shape)
        raw, reward, _, _ = self.sim_env.step(np.clip(action, -1.0, 1.0))
        success = self.is_success()
        terminated = bool(success and self.terminate_on_success)
        return self._convert(raw), float(reward), terminated, False, {"success": success}

    def render(self) -> np.ndarray | None:
        """(image_size, image_size, 3) uint8 frame from robosuite's default ``frontview`` camera (``render=True``)."""
        if not self.render_enabled:
            return None
        try:
            frame = self.sim_env.sim.render(
                camera_name=DEFAULT_RENDER_CAMERA, width=self.image_size, height=self.image_size
            )
        except Exception as error:  # the GL context is created lazily, on the first frame
            raise _offscreen_error(self.task_spec.sim_name, error) from error
        return np.ascontiguousarray(frame[::-1])

    def close(self) -> None:
        sim_env = getattr(self, "sim_env", None)
        if sim_env is not None:
            sim_env.close()
            self.sim_env = None
