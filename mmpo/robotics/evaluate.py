"""Evaluate a diffusion policy on a vectorised chunk env, exactly as DPPO samples during training.

Evaluation uses the same networks and chain as training (the fine-tuned copy on the last K'
steps; DPPO issue #29 was evaluating the base network only) with deterministic sampling
(the mean of each DDPM step / DDIM eta = 0). Episodes are spread evenly over the envs and only
each env's first ``quota`` episodes count, so short episodes are not over-represented.

The vector env must use gymnasium's SAME_STEP autoreset: at an episode end the returned obs is
the next episode's first obs and the final obs / info are under ``info["final_obs"]`` /
``info["final_info"]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from mmpo.robotics.policy import DiffusionPolicy


def check_same_step_autoreset(envs: Any) -> None:
    """Raise a clear error unless ``envs`` autoresets in SAME_STEP mode."""
    mode = getattr(envs, "metadata", {}).get("autoreset_mode")
    if mode is None or getattr(mode, "name", str(mode)).upper().split(".")[-1] != "SAME_STEP":
        raise ValueError(
            f"the vector env must use gymnasium's AutoresetMode.SAME_STEP (final obs in info), got {mode!r}"
        )


def step_info(infos: dict[str, Any], key: str, index: int, done: bool, default: Any = None) -> Any:
    """Value of ``key`` for env ``index`` at this step: from ``final_info`` where the episode ended
    (SAME_STEP autoreset merges the reset info into the top level), else from the top level."""
    source = infos.get("final_info", {}) if done else infos
    if key in source and source.get(f"_{key}", np.ones(index + 1, dtype=bool))[index]:
        return source[key][index]
    return default


def final_observations(next_obs: np.ndarray, infos: dict[str, Any], done: np.ndarray) -> np.ndarray:
    """Observation reached by each env's step: ``final_obs`` where the episode ended, else ``next_obs``."""
    reached = np.array(next_obs, dtype=np.float32, copy=True)
    if done.any():
        if "final_obs" not in infos:
            raise ValueError("an episode ended but info has no 'final_obs' (the vector env must use SAME_STEP autoreset)")
        for index in np.nonzero(done)[0]:
            reached[index] = np.asarray(infos["final_obs"][index], dtype=np.float32)
    return reached


@dataclass
class EpisodeTracker:
    """Per-env running return / length / success; finished episodes are appended to the lists."""

    num_envs: int
    quota: list[int] | None = None  # per env; None = record every episode
    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    successes: list[bool] = field(default_factory=list)
    faults: int = 0
    env_steps: int = 0
    records: list[dict[str, Any]] | None = None  # a list: one dict per recorded episode (env, ordinal, ...)

    def __post_init__(self) -> None:
        self._ret = np.zeros(self.num_envs)
        self._len = np.zeros(self.num_envs, dtype=np.int64)
        self._success = np.zeros(self.num_envs, dtype=bool)
        self._has_success = False
        self.finished = np.zeros(self.num_envs, dtype=np.int64)

    def reset(self) -> None:
        self._ret[:] = 0
        self._len[:] = 0
        self._success[:] = False

    def update(self, rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray, infos: dict[str, Any]) -> None:
        done = np.logical_or(terminated, truncated)
        for index in range(self.num_envs):
            executed = int(step_info(infos, "executed_steps", index, bool(done[index]), 1))
            self.env_steps += executed
            self._ret[index] += float(rewards[index])
            self._len[index] += executed
            success = step_info(infos, "success_any", index, bool(done[index]))
            if success is not None:
                self._has_success = True
                self._success[index] |= bool(success)
            if bool(step_info(infos, "fault", index, bool(done[index]), False)):
                self.faults += 1
            if done[index]:
                if self.quota is None or self.finished[index] < self.quota[index]:
                    self.returns.append(float(self._ret[index]))
                    self.lengths.append(int(self._len[index]))
                    self.successes.append(bool(self._success[index]))
                    if self.records is not None:
                        self.records.append({"env": index, "ordinal": int(self.finished[index]),
                                             "success": bool(self._success[index]), "return": float(self._ret[index]),
                                             "length": int(self._len[index])})
                self.finished[index] += 1
                self._ret[index], self._len[index], self._success[index] = 0.0, 0, False

    @property
    def complete(self) -> bool:
        return self.quota is not None and bool(np.all(self.finished >= np.asarray(self.quota)))

    def summary(self) -> dict[str, float]:
        """Mean return, success rate (NaN without a success signal), episodes, mean length, faults."""
        count = len(self.returns)
        return {
            "return": float(np.mean(self.returns)) if count else float("nan"),
            "success_rate": float(np.mean(self.successes)) if count and self._has_success else float("nan"),
            "episodes": float(count),
            "episode_length": float(np.mean(self.lengths)) if count else float("nan"),
            "faults": float(self.faults),
        }


def split_episodes(num_episodes: int, num_envs: int) -> list[int]:
    """Even per-env quotas summing to ``num_episodes`` (earlier envs take the remainder)."""
    if num_episodes < 1:
        raise ValueError(f"num_episodes must be >= 1, got {num_episodes}")
    base, remainder = divmod(num_episodes, num_envs)
    return [base + (1 if index < remainder else 0) for index in range(num_envs)]


@torch.no_grad()
def evaluate_policy(
    policy: DiffusionPolicy,
    envs: Any,
    num_episodes: int,
    *,
    deterministic: bool = True,
    seed: int | None = None,
    min_sampling_std: float = 0.1,
    noise_clip: float = 3.0,
    max_chunk_steps: int = 100_000,
    progress: bool = False,
    deterministic_sampler: str | None = None,
    generator: torch.Generator | None = None,
    ddpm_eval_std_floor: float | None = None,
    episode_records: list[dict[str, Any]] | None = None,
) -> dict[str, float]:
    """Roll out ``policy`` for ``num_episodes`` episodes on a SAME_STEP-autoreset vector chunk env.

    Args:
        policy: a DiffusionPolicy (with its fine-tuned copy if it has one: it is used).
        envs: gymnasium VectorEnv whose step takes (N, >= act_steps, Da) normalised chunks.
        num_episodes: episodes to record (spread evenly over the N envs).
        deterministic: mean of every denoising step (evaluation); False samples as in training.
        seed: reset seed (env i gets seed + i); None continues the envs' random streams.
        max_chunk_steps: safety cap on chunk steps (clear error if reached).
        deterministic_sampler: None (the policy's own chain: DDPM means) or "ddim" (eta = 0, same
            timesteps and networks); see :meth:`DiffusionPolicy.sample`.
        ddpm_eval_std_floor: deterministic DDPM chains: None = the mean of every step; a float = DPPO's
            official evaluation noise floor (1e-3), see :meth:`DiffusionPolicy.sample`.
        generator: source of the chains' initial (and, stochastic, step) noise, on the policy's
            device; None = torch's global RNG.
        episode_records: a list that receives one dict per recorded episode, in finishing order:
            ``env`` (index i, seeded ``seed + i``), ``ordinal`` (the episode's number in that env since
            the reset, 0-based), ``success``, ``return``, ``length``. With a ``seed``, (env, ordinal)
            names the same initial state for every policy (resets draw placements and robot noise from
            the env's seeded generator), so two policies' episodes can be paired on it.

    Returns:
        dict with ``return``, ``success_rate`` (NaN for tasks without success), ``episodes``,
        ``episode_length``, ``faults``, ``env_steps``.
    """
    check_same_step_autoreset(envs)
    policy.eval()
    num_envs = envs.num_envs
    tracker = EpisodeTracker(num_envs, quota=split_episodes(num_episodes, num_envs), records=episode_records)
    obs, _ = envs.reset(seed=seed)
    device = next(policy.parameters()).device
    bar = tqdm(total=num_episodes, desc="eval episodes", disable=not progress, leave=False)
    steps = 0
    while not tracker.complete:
        if steps >= max_chunk_steps:
            raise RuntimeError(f"evaluation did not finish {num_episodes} episodes within {max_chunk_steps} chunk steps")
        obs_tensor = torch.as_tensor(np.asarray(obs), dtype=torch.float32, device=device)
        actions = policy.sample(
            obs_tensor, deterministic=deterministic, min_sampling_std=min_sampling_std, noise_clip=noise_clip,
            deterministic_sampler=deterministic_sampler, generator=generator, ddpm_eval_std_floor=ddpm_eval_std_floor,
        ).actions
        before = len(tracker.returns)
        obs, rewards, terminated, truncated, infos = envs.step(actions.cpu().numpy())
        tracker.update(rewards, terminated, truncated, infos)
        bar.update(len(tracker.returns) - before)
        steps += 1
    bar.close()
    result = tracker.summary()
    result["env_steps"] = float(tracker.env_steps)
    return result
