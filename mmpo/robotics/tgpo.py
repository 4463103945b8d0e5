"""TGPO: Temporal Grounded Policy Optimization for STL tasks (Meng & Fan, 2025; docs/tgpo.md).

The STL task (a registered ``stl_*`` task, mmpo/robotics/envs/stl_envs.py) is decomposed into timed reach
subgoals and invariants (:func:`mmpo.robotics.tgpo_core.decompose`). The low level is a time-conditioned Gaussian
policy pi(a | s, t, stage, tau) (the env's observation carries t, the stage one-hot and the allocation tau)
trained by PPO + GAE on the dense stage-wise reward: :class:`TGPOModule` is a
:class:`~mmpo.robotics.gaussian_ppo.GaussianPPOModule` (same rollout, critic, core ``policy_loss``, shared update
engine, checkpoints and resume) whose policy starts from scratch and whose every rollout starts from a new
allocation per env:

- training (``tgpo.sampler="mh"``): each env carries a Metropolis-Hastings chain over allocations; at every
  reset the envs' initial states s0 are drawn, each chain proposes ``tau' = project(round(tau + std * eps))``
  and accepts with ``min(1, exp((V(s0, tau') - V(s0, tau)) / T))``, V being the PPO critic evaluated on the
  initial observation with tau' in place of tau; the envs are then reset again with the same seed (same s0)
  under the chains' allocations. ``sampler="uniform"`` draws tau uniformly instead (the paper's ablation).
- evaluation: ``tgpo.eval_candidates`` allocations drawn uniformly per env; each env runs the best by V(s0, tau).

One rollout is one episode per env (``env.n_steps * act_steps`` must equal the task's horizon H, with
``reset_at_iteration``), so every episode runs the allocation chosen for its own s0. The chains' states and
their generator are checkpointed (``tgpo_state``), so a resumed run continues them exactly.

Metrics (besides Gaussian PPO's): ``tgpo/mh_accept_rate``, ``tgpo/tau_mean`` (mean allocated step of the chains),
``charts/success_rate`` / ``eval/success_rate`` = STL satisfaction rate (robustness > 0 on the episode).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch

from mmpo.robotics.config import EnvConfig, EvalConfig, GaussianPolicyConfig, PPOLossConfig, ReturnsConfig, TGPOConfig
from mmpo.robotics.dppo import EnvFactory
from mmpo.robotics.envs.tasks import get_task
from mmpo.robotics.gaussian_ppo import GaussianChunkPolicy, GaussianPPOModule
from mmpo.robotics.tgpo_core import Decomposition, best_by_value, mh_step
from mmpo.training.config import CriticConfig, OptimConfig, as_config
from mmpo.training.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS
from mmpo.training.state_hooks import CheckpointedState

TGPO_OPTIM = OptimConfig(lr=3e-4, weight_decay=0.0, max_grad_norm=0.5, mu=5, minibatch_size=256)
"""The actor's AdamW and update loop (standard PPO values; the paper's are not published: docs/tgpo.md)."""
TGPO_ENV = EnvConfig(task="stl_pointmass2", act_steps=1, num_envs=16, n_steps=40, asynchronous=False)
TGPO_RETURNS = ReturnsConfig(gamma=0.99, lam=0.95, reward_scale_running=False)
TGPO_GAUSSIAN = GaussianPolicyConfig(clip_coef=0.2, ent_coef=0.0, noise_clip=3.0)
TGPO_CRITIC = CriticConfig(lr=1e-3, vf_coef=0.5, warmup_iterations=0, hidden_dims=[64, 64, 64])
TGPO_EVAL = EvalConfig(every=10, episodes=16)


def task_decomposition(task: str) -> tuple[Decomposition, int]:
    """(decomposition, horizon H) of a registered STL task (built once from its gymnasium env)."""
    spec = get_task(task)
    env = gym.make(spec.sim_name, disable_env_checker=True)
    try:
        inner = env.unwrapped
        if not hasattr(inner, "decomposition"):
            raise ValueError(f"task {task!r} is not an STL task (TGPO needs one of the stl_* tasks)")
        return inner.decomposition, int(inner.horizon)
    finally:
        env.close()


class AllocationChains:
    """One MH chain state tau (N, K) per env, the search's generator and its acceptance counts (checkpointed)."""

    def __init__(self, decomposition: Decomposition, num_envs: int, seed: int) -> None:
        self.tau = decomposition.midpoints(num_envs)
        self.generator = torch.Generator().manual_seed(int(seed))
        self.accepted = 0
        self.proposed = 0

    def state_dict(self) -> dict[str, Any]:
        return {"tau": self.tau.clone(), "generator": self.generator.get_state(), "accepted": self.accepted,
                "proposed": self.proposed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tau = state["tau"].clone()
        self.generator.set_state(state["generator"])
        self.accepted, self.proposed = int(state["accepted"]), int(state["proposed"])


class TGPOModule(CheckpointedState, GaussianPPOModule):
    """TGPO on a registered STL task (``env.task``: ``stl_pointmass2``..4, ``stl_reacher2``..4).

    Args:
        num_iterations: PPO iterations (one rollout = one episode per env + update).
        tgpo: the policy network and the allocation search (:class:`~mmpo.robotics.config.TGPOConfig`).
        gaussian, env, returns, loss, optim, critic, evaluation, seed, env_factory, max_consecutive_skips: as
            :class:`~mmpo.robotics.gaussian_ppo.GaussianPPOModule`, with TGPO's defaults (``TGPO_*`` above); the
            policy is built from ``tgpo`` (no BC checkpoint), seeded by ``seed``.
    """

    config_groups = GaussianPPOModule.config_groups + ("tgpo",)
    flat_names: dict[str, tuple[str, str]] = {}
    checkpointed_state = (("tgpo_state", "allocator"),)

    def __init__(
        self,
        num_iterations: int = 100,
        *,
        tgpo: TGPOConfig = TGPOConfig(),
        gaussian: GaussianPolicyConfig = TGPO_GAUSSIAN,
        env: EnvConfig = TGPO_ENV,
        returns: ReturnsConfig = TGPO_RETURNS,
        loss: PPOLossConfig = PPOLossConfig(target_kl=None),
        optim: OptimConfig = TGPO_OPTIM,
        critic: CriticConfig = TGPO_CRITIC,
        evaluation: EvalConfig = TGPO_EVAL,
        seed: int = 0,
        env_factory: EnvFactory | None = None,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
    ) -> None:
        self.tgpo = as_config(tgpo, TGPOConfig())
        env = as_config(env, TGPO_ENV)
        if env.task is None:
            raise ValueError("TGPO needs env.task: one of the stl_* tasks (e.g. stl_pointmass2)")
        self.decomposition, self.stl_horizon = task_decomposition(env.task)
        self._policy_seed = int(seed)
        super().__init__("", num_iterations, gaussian=as_config(gaussian, TGPO_GAUSSIAN), env=env,
                         returns=as_config(returns, TGPO_RETURNS), loss=loss, optim=as_config(optim, TGPO_OPTIM),
                         critic=as_config(critic, TGPO_CRITIC), evaluation=as_config(evaluation, TGPO_EVAL),
                         seed=seed, env_factory=env_factory, max_consecutive_skips=max_consecutive_skips)
        self.hparams.pop("bc_checkpoint", None)  # TGPO trains from scratch
        if self.env.n_steps * self.act_steps != self.stl_horizon or not self.env.reset_at_iteration:
            raise ValueError(f"TGPO runs one episode per env per rollout: env.n_steps x act_steps must equal the "
                             f"task's horizon {self.stl_horizon} and env.reset_at_iteration be true, got n_steps="
                             f"{self.env.n_steps}, act_steps={self.act_steps}, reset_at_iteration="
                             f"{self.env.reset_at_iteration}")
        self.allocator = AllocationChains(self.decomposition, self.env.num_envs, seed + 1)
        self.allocation_metrics: dict[str, float] = {}

    def load_actor(self, bc_checkpoint: str, ft_steps: int) -> tuple[GaussianChunkPolicy, dict[str, Any]]:
        """A fresh time-conditioned Gaussian policy on the task's observation (seeded by ``seed``)."""
        spec = get_task(self.env.task)
        horizon = int(self.env.act_steps or 1)
        config = self.tgpo
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self._policy_seed)
            policy = GaussianChunkPolicy(spec.obs_dim, spec.action_dim, horizon,
                                         hidden_dims=config.hidden_dims or [64, 64, 64], activation=config.activation,
                                         init_std=config.init_std, min_std=config.min_std)
        metadata = {"task": spec.name, "act_steps": horizon, "max_episode_steps": None, "normalizer_path": None}
        return policy, metadata

    # ------------------------------------------------------------------ time allocations
    def initial_values(self, obs0: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        """V(s0, tau): the critic on the initial observations (N, obs_dim) with their last K entries (tau / H)
        replaced by the allocations ``tau`` (N, K): (N,)."""
        k = self.decomposition.num_subgoals
        tail = tau.to(obs0.dtype) / self.stl_horizon
        with torch.no_grad():
            return self.critic(torch.cat([obs0[:, :-k], tail.to(obs0.device)], dim=1)).double().cpu()

    def _set_allocations(self, tau: torch.Tensor) -> None:
        self.envs.set_attr("tgpo_tau", [row.numpy().copy() for row in tau])

    def _reset_envs(self) -> None:
        """Reset (draws s0), choose every env's allocation for its s0, reset again with the same seed."""
        super()._reset_envs()
        obs0 = torch.as_tensor(self._obs, dtype=torch.float32, device=self.device)
        chains, config = self.allocator, self.tgpo
        if config.sampler == "uniform":
            tau = self.decomposition.uniform(obs0.shape[0], chains.generator)
        else:
            tau = chains.tau
            for _ in range(config.mh_steps):
                tau, accepted = mh_step(tau, lambda t: self.initial_values(obs0, t), self.decomposition,
                                        temperature=config.temperature, proposal_std=config.proposal_std,
                                        generator=chains.generator)
                chains.accepted += int(accepted.sum())
                chains.proposed += int(accepted.numel())
            chains.tau = tau
        self._set_allocations(tau)
        super()._reset_envs()
        self.allocation_metrics = {"tgpo/mh_accept_rate": chains.accepted / max(chains.proposed, 1),
                                   "tgpo/tau_mean": float(tau.double().mean())}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Log the allocation search of the iteration's rollout (and keep it in ``last_metrics``)."""
        if self.allocation_metrics:
            self.log_dict(self.allocation_metrics, on_step=True, on_epoch=False, batch_size=1)
            self.last_metrics.update(self.allocation_metrics)

    def evaluation_allocations(self, obs0: torch.Tensor, seed: int) -> torch.Tensor:
        """Per env, the best of ``tgpo.eval_candidates`` uniform allocations by V(s0, tau): (N, K)."""
        generator = torch.Generator().manual_seed(seed)
        candidates = [self.decomposition.uniform(obs0.shape[0], generator) for _ in range(self.tgpo.eval_candidates)]
        return best_by_value(candidates, lambda t: self.initial_values(obs0, t))

    def evaluate(self, num_episodes: int | None = None) -> dict[str, float]:
        """Gaussian PPO's deterministic evaluation, each env running the allocation picked by V for the s0 that
        the evaluation's seeded reset draws (later episodes of an env, when episodes > num_envs, keep it)."""
        seed = self.hparams.seed + 10_000 + self.iteration
        self._collect_prefetched_reset()
        obs0, _ = self.envs.reset(seed=seed)
        tau = self.evaluation_allocations(torch.as_tensor(np.asarray(obs0), dtype=torch.float32, device=self.device),
                                          seed)
        self._set_allocations(tau)
        return super().evaluate(num_episodes)

    def robotics_metadata(self) -> dict[str, Any]:
        return {**super().robotics_metadata(), "kind": "tgpo"}
