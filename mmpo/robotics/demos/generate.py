"""Roll out a scripted expert and save robomimic-format demos plus normaliser stats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from mmpo.robotics.demos.experts import ScriptedExpert
from mmpo.robotics.demos.hdf5_writer import RobomimicHDF5Writer
from mmpo.robotics.envs.make import make_env
from mmpo.robotics.envs.normalizer import DATA_HASH_KEY, Normalizer, stats_path_for
from mmpo.robotics.envs.robosuite_env import RobosuiteGymEnv, flatten_obs, robomimic_obs_dict
from mmpo.robotics.envs.tasks import get_task
from mmpo.files import atomic_outputs, file_sha256

#: steps kept after the first success so the demo shows the goal being held (robomimic
#: PH demos also end shortly after success).
DEFAULT_STEPS_AFTER_SUCCESS = 3


def robomimic_env_args(env: RobosuiteGymEnv) -> dict[str, Any]:
    """robomimic env metadata (``EnvUtils.create_env_from_metadata`` input): type 1 = robosuite."""
    import robosuite

    kwargs = dict(env.env_kwargs)
    kwargs["robots"] = list(kwargs["robots"])
    return {"env_name": env.task_spec.sim_name, "env_version": robosuite.__version__, "type": 1, "env_kwargs": kwargs}


def _stack(dicts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {key: np.stack([d[key] for d in dicts]) for key in dicts[0]}


def _episode(env, expert: ScriptedExpert, max_steps: int, steps_after_success: int) -> dict[str, Any]:
    base: RobosuiteGymEnv = env.unwrapped
    env.reset()
    expert.start_episode(base)
    obs, next_obs, actions, rewards, states = [], [], [], [], []
    success = fault = False
    after = 0
    for _ in range(max_steps):
        raw = base.last_raw_obs
        states.append(base.get_sim_state())
        obs.append(robomimic_obs_dict(raw))
        action = expert.act(raw)
        _, reward, terminated, truncated, info = env.step(action)
        if info.get("fault", False):
            fault = True
            break
        actions.append(action)
        rewards.append(reward)
        next_obs.append(robomimic_obs_dict(base.last_raw_obs))
        success = success or bool(info["success"])
        after += int(success)
        if (success and after > steps_after_success) or terminated or truncated:
            break
    length = len(actions)
    dones = np.zeros(length, dtype=np.int64)
    if length:
        dones[-1] = 1
    return {
        "obs": obs[:length],
        "next_obs": next_obs,
        "actions": np.asarray(actions, dtype=np.float64).reshape(length, -1),
        "rewards": np.asarray(rewards, dtype=np.float64),
        "dones": dones,
        "states": np.asarray(states[:length]),
        "success": success and not fault,
        "fault": fault,
        "model_file": base.sim_env.sim.model.get_xml(),
    }


def generate_demos(
    task: str,
    num_demos: int,
    out_path: str | Path,
    *,
    noise: float = 0.0,
    seed: int = 0,
    max_steps: int | None = None,
    keep_failures: bool = False,
    max_attempts: int | None = None,
    steps_after_success: int = DEFAULT_STEPS_AFTER_SUCCESS,
    store_model_file: bool = True,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Scripted-expert demos of a registered robosuite task in robomimic's HDF5 layout.

    Args:
        task: a task in ``mmpo.robotics.envs.TASKS`` whose entry has an ``expert`` ("lift", "can", "square"
            or one added with ``register_task``).
        num_demos: demos to write (successful ones unless ``keep_failures``).
        out_path: the .hdf5 file; normaliser stats go to ``<out_path>.stats.json``.
        noise: std of the Gaussian added to every expert action dimension (then clipped).
        seed: seeds the env layouts and the noise.
        max_steps: cap per episode (default: the task's time limit, 300).
        keep_failures: also write failed attempts (e.g. to study noisy data).
        max_attempts: give up after this many episodes (default 3 * num_demos + 10).
        steps_after_success: steps recorded after the first success.
        store_model_file: store the MJCF XML per demo (robomimic's ``model_file`` attr).
        progress: show a tqdm bar.
        overwrite: replace an existing ``out_path`` (otherwise ``FileExistsError``).

    Both files are written under temp names beside ``out_path`` and moved into place only when
    generation has finished (data first, then stats carrying the data's SHA-256), so an
    interrupted run leaves any previous dataset and its stats untouched.

    Returns:
        dict with ``path``, ``stats_path``, ``num_demos`` (written), ``attempts``,
        ``successes``, ``success_rate`` (successes / attempts), ``mean_length`` (written
        demos), ``total_samples``, ``faults``, ``noise``.
    """
    spec = get_task(task)
    if spec.family != "robosuite":
        raise ValueError(f"scripted demos exist for robosuite tasks only, not {task!r}")
    if spec.expert is None:
        raise ValueError(f"task {task!r} has no scripted expert (TaskSpec.expert); register one with register_task")
    if num_demos < 1:
        raise ValueError(f"num_demos must be >= 1, got {num_demos}")
    limit = int(max_steps or spec.max_episode_steps)
    attempts_allowed = int(max_attempts or 3 * num_demos + 10)
    out_path = Path(out_path)
    stats_path = stats_path_for(out_path)
    existing = [str(path) for path in (out_path, stats_path) if path.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{' and '.join(existing)} already exist; pass overwrite=True (--overwrite) to replace")
    with atomic_outputs(out_path, stats_path) as (partial_data, partial_stats):
        stats = _generate_into(task, spec, num_demos, partial_data, partial_stats, noise=noise, seed=seed, limit=limit,
                               keep_failures=keep_failures, attempts_allowed=attempts_allowed,
                               steps_after_success=steps_after_success, store_model_file=store_model_file,
                               progress=progress)
    return {"path": str(out_path), "stats_path": str(stats_path), **stats}


def _generate_into(task: str, spec: Any, num_demos: int, data_path: Path, stats_path: Path, *, noise: float,
                   seed: int, limit: int, keep_failures: bool, attempts_allowed: int, steps_after_success: int,
                   store_model_file: bool, progress: bool) -> dict[str, Any]:
    """Roll out and write the demos to ``data_path`` and their stats (with the data's hash) to ``stats_path``."""
    env = make_env(task, seed=seed, max_episode_steps=limit)
    expert = spec.make_expert(noise=noise, rng=np.random.default_rng(seed + 1))
    attempts = successes = faults = 0
    flat_obs, all_actions, lengths = [], [], []
    bar = tqdm(total=num_demos, desc=f"{task} demos", disable=not progress, unit="demo")
    try:
        with RobomimicHDF5Writer(data_path, robomimic_env_args(env.unwrapped)) as writer:
            while len(lengths) < num_demos and attempts < attempts_allowed:
                episode = _episode(env, expert, limit, steps_after_success)
                attempts += 1
                successes += int(episode["success"])
                faults += int(episode["fault"])
                keep = (episode["success"] or keep_failures) and len(episode["actions"]) > 0
                if keep:
                    obs = _stack(episode["obs"])
                    writer.add_demo(
                        obs,
                        _stack(episode["next_obs"]),
                        episode["actions"],
                        episode["rewards"],
                        episode["dones"],
                        episode["states"],
                        model_file=episode["model_file"] if store_model_file else None,
                    )
                    # float64 like the stored obs, so min/max map the stored data exactly onto [-1, 1]
                    flat = np.stack([flatten_obs(o, spec.obs_keys, np.float64) for o in episode["obs"]])
                    flat_obs.append(flat)
                    all_actions.append(episode["actions"])
                    lengths.append(len(episode["actions"]))
                    bar.update(1)
                bar.set_postfix(success_rate=f"{successes / attempts:.2f}", attempts=attempts)
    finally:
        bar.close()
        env.close()
    if not lengths:
        raise RuntimeError(f"no demo written for {task!r} after {attempts} attempts (noise={noise})")
    normalizer = Normalizer.from_data(
        np.concatenate(flat_obs), np.concatenate(all_actions), obs_keys=list(spec.obs_keys), task=spec.name,
        **{DATA_HASH_KEY: file_sha256(data_path)},
    )
    if spec.image_dims:  # pixels keep their fixed range: [0, 255] -> [-1, 1] (DPPO: x / 255 - 0.5, half that scale)
        normalizer.obs_min[-spec.image_dims:], normalizer.obs_max[-spec.image_dims:] = 0.0, 255.0
    normalizer.save(stats_path)
    return {
        "num_demos": len(lengths),
        "attempts": attempts,
        "successes": successes,
        "success_rate": successes / attempts,
        "mean_length": float(np.mean(lengths)),
        "total_samples": int(np.sum(lengths)),
        "faults": faults,
        "noise": float(noise),
    }
