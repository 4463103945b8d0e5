"""DPPO: PPO fine-tuning of a diffusion policy through its denoising MDP (arXiv 2409.00588).

Each env step's K-step denoising chain is a sequence of Gaussian policy steps with exact
log-likelihoods. A frozen copy of the pre-trained (BC) network runs the first K - K' chain
steps, a trainable copy (initialised from it) the last K'. One ``training_step`` of
:class:`DPPOModule` is one DPPO iteration:

1. roll out ``n_steps`` chunk steps on ``num_envs`` vectorised envs, sampling with the std
   floor (0.1) and noise clip (3) on every denoising step, storing the last K'+1 chain states
   and the per-step log-probs (std floor 0.1, clamp [-5, 2], mean over executed steps and dims);
2. running reward scaling, then GAE over chunk steps through :func:`mmpo.core.gae`
   (terminations stop bootstrapping, truncations bootstrap from V(final obs));
3. ``update_epochs`` passes of minibatches of (env step, denoising step) pairs: advantages
   normalised per minibatch and multiplied by gamma_denoise^(K'-1-i), the PPO clip loss of
   :func:`mmpo.core.policy_loss` (``loss``: ``ppo``, or another loss of :data:`DPPO_LOSSES`) with the
   exponential per-denoising-step clip range, critic MSE
   with coefficient 0.5; the actor is not stepped during the critic warm-up iterations;
4. every ``eval_every`` iterations a deterministic evaluation with the fine-tuned network.

Metrics: ``charts/return``, ``charts/success_rate`` (finished training episodes),
``eval/return``, ``eval/success_rate``, ``losses/policy``, ``losses/value``, ``policy/clipfrac``,
``policy/approx_kl``, ``perf/env_steps_per_s``, ``perf/faults``, ``perf/env_worker_restarts``.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from mmpo.algos.config import rng_state, set_rng_state
from mmpo.core import POLICY_LOSSES, gae, policy_loss
from mmpo.core import LossParts
from mmpo.training.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS, NonFiniteGuard, NonFiniteGuardMixin
from mmpo.training.update import MicroLoss, PassContext, UpdateEngine, UpdateSchedule, UpdateWrapper
from mmpo.training.optim import make_adamw
from mmpo.robotics.envs.chunking import SKIP_AUTORESET_AFTER
from mmpo.robotics.evaluate import EpisodeTracker, check_same_step_autoreset, evaluate_policy, final_observations
from mmpo.robotics.policy import CriticMLP, DiffusionPolicy
from mmpo.robotics.policy.dppo_math import (
    RunningRewardScaler,
    clip_schedule,
    denoising_discount,
    normalize_advantages,
    reduce_step_log_prob,
)
from mmpo.robotics.policy.io import build_policy, load_policy

EnvFactory = Callable[..., Any]

# Core policy losses whose math holds for one (env step, denoising step) pair's Gaussian log-likelihood: token-ratio
# rules. Those with clip bounds get the per-denoising-step clip range; sapo and gpg have none (docs/dppo.md).
DPPO_LOSSES: tuple[str, ...] = ("ppo", "gppo", "cispo", "aspo", "sapo", "gpg")
# Why the other registered losses do not apply here (the error a config naming one of them gets).
NOT_FOR_DPPO: dict[str, str] = {
    **dict.fromkeys(("gspo", "gmpo", "luspo", "vespo", "igpo_sequence"),
                    "a sequence-level ratio: DPPO's minibatch rows are single shuffled (env step, denoising step) "
                    "pairs, so the 'sequence' would be one denoising step"),
    "dcpo": "its bounds assume pi_old is a token probability in (0, 1]; DPPO's are Gaussian densities",
    **dict.fromkeys(("clip_cov", "kl_cov"),
                    "they guard a softmax policy's entropy (its change ~ -Cov(log pi, A)); a Gaussian denoising step's "
                    "entropy is set by its std schedule, not by the log-probs these losses select on"),
    "hapo": "it adapts clip bounds and advantages to the per-token entropy of a softmax policy; a Gaussian denoising "
            "step's entropy is set by its std schedule, not learned",
}


@dataclass
class Rollout:
    """One iteration's data, time-major. T chunk steps, N envs, K' fine-tuned denoising steps.

    obs (T, N, obs_dim); chains (T, N, K'+1, Ta, Da); old_log_probs (T, N, K');
    rewards / scaled_rewards (T, N); terminated, truncated, episode_start (T, N) bool;
    reached_obs (T, N, obs_dim): the obs each step reached (final obs at episode ends).
    """

    obs: torch.Tensor
    chains: torch.Tensor
    old_log_probs: torch.Tensor
    rewards: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    episode_start: torch.Tensor
    reached_obs: torch.Tensor
    scaled_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None


def dppo_loss_settings(loss: str, clip: torch.Tensor, loss_settings: dict[str, Any] | None) -> dict[str, Any]:
    """Keyword settings of ``loss`` for one minibatch: ``clip`` ``(B, 1)`` as clip_low and clip_high of the
    losses that have them, then ``loss_settings``."""
    params = inspect.signature(POLICY_LOSSES.get(loss)).parameters
    settings: dict[str, Any] = {name: clip for name in ("clip_low", "clip_high") if name in params}
    return {**settings, **(loss_settings or {})}


def check_dppo_loss(loss: str, loss_settings: dict[str, Any] | None) -> None:
    """Fail at construction, with the reason, for a loss DPPO cannot use or settings it would reject."""
    if loss not in DPPO_LOSSES:
        reason = NOT_FOR_DPPO.get(loss, "not a registered core loss" if loss not in POLICY_LOSSES
                                  else "not checked for DPPO's per-denoising-step log-probs")
        raise ValueError(f"loss {loss!r} does not apply to DPPO ({reason}); valid: {list(DPPO_LOSSES)}")
    clash = sorted({"clip_low", "clip_high"} & set(loss_settings or {}))
    if clash:
        raise ValueError(f"loss_settings {clash} are set by the per-denoising-step clip range (clip_base, "
                         f"clip_final, clip_rate); remove them")
    one = torch.zeros(1, 1)
    policy_loss(loss, one, one, one[:, 0], torch.ones(1, 1), **dppo_loss_settings(loss, one + 0.1, loss_settings))


class _IterationIndices(Dataset):
    """``num_iterations`` dummy items: Lightning calls ``training_step`` once per DPPO iteration."""

    def __init__(self, num_iterations: int) -> None:
        self.num_iterations = num_iterations

    def __len__(self) -> int:
        return self.num_iterations

    def __getitem__(self, index: int) -> int:
        return index


def iteration_loader(num_iterations: int) -> DataLoader:
    """One dummy item per iteration. The loader gets its own generator: starting an iterator draws a
    seed from it, and from torch's global RNG without one, which would then differ after a resume."""
    return DataLoader(_IterationIndices(num_iterations), batch_size=None, shuffle=False,
                      generator=torch.Generator().manual_seed(0))


class OnPolicyDataModule(pl.LightningDataModule):
    """The data side of an on-policy run: rollouts are collected by the module itself, so this only
    hands Lightning one item per DPPO iteration (``mmpo fit`` configs need a ``data`` entry)."""

    def train_dataloader(self) -> DataLoader:
        return iteration_loader(self.trainer.lightning_module.hparams.num_iterations)


class DPPOModule(NonFiniteGuardMixin, pl.LightningModule):
    """DPPO fine-tuning (arXiv 2409.00588) of a BC diffusion policy on a vectorised chunk env.

    Args:
        bc_checkpoint: BC checkpoint (``.ckpt`` from ``mmpo fit -c configs/robotics/bc_*.yaml`` or
            ``policy.safetensors``); its EMA policy becomes the frozen base and the fine-tuned copy.
        num_iterations: DPPO iterations (rollout + update) of the fit.
        task, act_steps, max_episode_steps, normalizer_path: env settings (default: the checkpoint's).
        num_envs, n_steps: envs and chunk steps per env per iteration (lift: 50, 300).
        ft_steps: K', fine-tuned (last) denoising steps (default 10 of K = 20).
        gamma, gae_lambda: env-level GAE over chunk steps (robomimic 0.999, 0.95).
        gamma_denoise: advantage discount over denoising steps (0.99).
        clip_base, clip_final, clip_rate: per-denoising-step clip range (0.001 -> 0.01, rate 3).
        loss: core policy loss of the actor: 'ppo' (DPPO's), or 'gppo', 'cispo', 'aspo' (their clip_low / clip_high
            are the per-denoising-step clip range), 'sapo', 'gpg' (no clip: the range is unused); see docs/dppo.md
            for why the other core losses do not apply.
        loss_settings: further keyword settings of the loss (e.g. sapo's tau_pos / tau_neg; not the clip bounds).
        min_sampling_std, noise_clip, min_logprob_std: DPPO's floors/clip (0.1, 3, 0.1).
        logprob_min, logprob_max: elementwise log-prob clamp (-5, 2).
        actor_lr, critic_lr, weight_decay: AdamW (1e-4, 1e-3, 0).
        batch_size: (env step, denoising step) pairs per minibatch (lift 7500).
        update_epochs: passes over the rollout per iteration (10).
        vf_coef: value-loss coefficient (0.5).
        target_kl: stop an iteration's epochs when approx_kl exceeds it (None: never).
        max_grad_norm: gradient clipping (None: off, as DPPO).
        n_critic_warmup_itr: first iterations that train only the critic (robomimic 2).
        reward_scale_running: running reward scaling (True); reward_scale_const multiplies rewards first.
        reward_scale_gamma: discount of the running return whose std scales rewards (DPPO's RunningRewardScaler: 0.99).
        reset_at_iteration: reset envs at each iteration's start (robomimic True, Gym False).
        eval_every, eval_episodes: deterministic evaluation cadence (0 = never) and episode count.
        eval_sampler: None = the policy's own DDPM chain; "ddim" = DDIM eta = 0 over the same timesteps
            with the same networks.
        eval_ddpm_std_floor: the DDPM evaluation chain: None (default, the results recorded in
            bench/RESULTS.md) = the mean of every step; 1e-3 = the official DPPO evaluation, which adds noise
            with std max(std, 1e-3) on every step but the last.
        rollout_ddim_steps: None (default) = fine-tune the BC policy's own DDPM chain; n = run rollouts, updates
            and evaluation on a DDIM (eta = 1, exact Gaussian log-probs) chain of n strided steps of its K training
            timesteps, with the same network (DPPO's DDIM fine-tuning; fewer network calls per env step).
            ft_steps counts steps of that chain (1 <= ft_steps <= n).
        critic_hidden_dims: critic ResidualMLP widths ([256, 256, 256]).
        seed: env seed (env i: seed + i) and torch seed of sampling.
        env_factory: callable ``(num_envs=..., seed=..., act_steps=...) -> VectorEnv`` (SAME_STEP
            autoreset) replacing ``mmpo.robotics.envs.make_vector_env`` (used by tests).
        asynchronous: subprocess envs (True) or in-process (False).
        max_consecutive_skips: minibatch steps with a non-finite loss or gradient norm are skipped (actor, critic
            and optimizer states untouched, counted as perf/skipped_steps); this many in a row stop the run with
            NonFiniteTrainingError (mmpo.training.nonfinite).
        max_env_worker_restarts: env worker processes that may die and be restarted during the fit
            (their episodes end as faults; logged as ``perf/env_worker_restarts``) before the run stops
            with an error naming the worker and its env.
        env_groups: 1 (default) = one batched policy call on all envs, then all envs step. g > 1 = pipelined
            collection: the envs are split into g groups of consecutive envs (mmpo.robotics.envs.groups.EnvGroups, one
            vector env each, env i still seeded seed + i) and while one group's worker processes step the
            simulator, this process computes the next group's actions. The rollout has the same layout,
            bookkeeping and chain noise (drawn for all envs at once and split by rows); the policy's outputs
            differ from env_groups=1 only by float rounding (a smaller batch in the network's matmuls).
        prefetch_reset: False (default) = each rollout starts with a blocking env reset. True (with
            reset_at_iteration and subprocess envs) = the next iteration's reset is sent to the workers right
            after the rollout, so they reset (a robosuite hard reset rebuilds the model: ~0.1 s per env) while
            this process runs GAE and the PPO update; the next rollout only collects the result. The reset is
            the same (its seed depends only on the iteration), so the run is unchanged; not done before an
            evaluation (which resets the envs itself) or after the last iteration.
        skip_final_autoreset: True (default; with reset_at_iteration) = an env whose episode ends on the rollout's
            last chunk step is not auto-reset (mmpo.robotics.envs.chunking.SKIP_AUTORESET_AFTER): the next iteration
            resets every env with its own seed anyway, so that reset's observation would be thrown away, and a
            robosuite hard reset costs ~0.1 s in the middle of the rollout. The rollout is unchanged (its last
            step records the episode's final observation either way). False = gymnasium's plain autoreset.
    """

    def __init__(
        self,
        bc_checkpoint: str,
        num_iterations: int = 81,
        *,
        task: str | None = None,
        act_steps: int | None = None,
        max_episode_steps: int | None = None,
        normalizer_path: str | None = None,
        num_envs: int = 50,
        n_steps: int = 300,
        ft_steps: int = 10,
        gamma: float = 0.999,
        gae_lambda: float = 0.95,
        gamma_denoise: float = 0.99,
        clip_base: float = 0.001,
        clip_final: float = 0.01,
        clip_rate: float = 3.0,
        loss: str = "ppo",
        loss_settings: dict[str, Any] | None = None,
        min_sampling_std: float = 0.1,
        noise_clip: float = 3.0,
        min_logprob_std: float = 0.1,
        logprob_min: float = -5.0,
        logprob_max: float = 2.0,
        actor_lr: float = 1e-4,
        critic_lr: float = 1e-3,
        weight_decay: float = 0.0,
        batch_size: int = 7500,
        update_epochs: int = 10,
        vf_coef: float = 0.5,
        target_kl: float | None = 1.0,
        max_grad_norm: float | None = None,
        n_critic_warmup_itr: int = 2,
        reward_scale_running: bool = True,
        reward_scale_const: float = 1.0,
        reward_scale_gamma: float = 0.99,
        reset_at_iteration: bool = True,
        eval_every: int = 10,
        eval_episodes: int = 50,
        eval_sampler: str | None = None,
        eval_ddpm_std_floor: float | None = None,
        rollout_ddim_steps: int | None = None,
        critic_hidden_dims: list[int] | None = None,
        seed: int = 0,
        env_factory: EnvFactory | None = None,
        asynchronous: bool = True,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
        max_env_worker_restarts: int = 3,
        env_groups: int = 1,
        prefetch_reset: bool = False,
        skip_final_autoreset: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["env_factory"])
        self.automatic_optimization = False
        self.nonfinite = NonFiniteGuard(max_consecutive_skips)
        for name, value in (("num_iterations", num_iterations), ("num_envs", num_envs), ("n_steps", n_steps),
                            ("batch_size", batch_size), ("update_epochs", update_epochs)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 1 <= int(env_groups) <= int(num_envs):
            raise ValueError(f"env_groups must be in [1, num_envs={num_envs}], got {env_groups}")
        if not 0.0 <= reward_scale_gamma <= 1.0:
            raise ValueError(f"reward_scale_gamma must be in [0, 1], got {reward_scale_gamma}")
        if eval_ddpm_std_floor is not None and eval_ddpm_std_floor < 0:
            raise ValueError(f"eval_ddpm_std_floor must be >= 0 or None, got {eval_ddpm_std_floor}")
        check_dppo_loss(loss, loss_settings)
        policy, metadata = self.load_actor(bc_checkpoint, ft_steps)
        self.source_metadata = metadata
        self.task = task or metadata.get("task")
        self.act_steps = int(act_steps or metadata.get("act_steps") or policy.horizon)
        if not 1 <= self.act_steps <= policy.horizon:
            raise ValueError(f"act_steps must be in [1, horizon={policy.horizon}], got {self.act_steps}")
        self.max_episode_steps = max_episode_steps or metadata.get("max_episode_steps")
        self.normalizer_path = normalizer_path or metadata.get("normalizer_path")
        self.policy: DiffusionPolicy = policy
        self.critic = CriticMLP(policy.obs_dim, critic_hidden_dims or [256, 256, 256])
        self.register_buffer("clip_ranges", clip_schedule(ft_steps, clip_base, clip_final, clip_rate), persistent=False)
        self.env_factory = env_factory
        self.envs: Any = None
        self.reward_scaler = RunningRewardScaler(num_envs, gamma=reward_scale_gamma) if reward_scale_running else None
        self._obs: np.ndarray | None = None
        self._episode_start: np.ndarray | None = None
        self._prefetched_reset_seed: int | None = None  # the seed of a reset sent to the workers, not yet collected
        self.train_tracker = EpisodeTracker(num_envs)
        self.iteration = 0
        self._generator = torch.Generator().manual_seed(seed)
        # DPPO clips the actor's and the critic's gradient norms separately (None: no clipping, as DPPO)
        self.update_engine = UpdateEngine(
            self, max_grad_norm=max_grad_norm,
            clip_groups=lambda: [list(self.policy.ft_network.parameters()), list(self.critic.parameters())])
        # how a whole update pass runs: as is, or wrapped by a variant (SFPO's slow-fast pass of the actor)
        self.update_wrapper: UpdateWrapper = UpdateWrapper()

    def load_actor(self, bc_checkpoint: str, ft_steps: int) -> tuple[Any, dict[str, Any]]:
        """The policy to fine-tune and its checkpoint's metadata: the BC diffusion policy with a trainable
        copy of its last ``ft_steps`` denoising steps (a subclass loads another policy family)."""
        policy, metadata = load_policy(bc_checkpoint)
        ddim_steps = self.hparams.rollout_ddim_steps
        if ddim_steps is not None and policy.policy_config["sampler"] == "ddpm":
            # Same eps network on a strided DDIM (eta = 1) chain of ddim_steps of the K training timesteps: each
            # step stays Gaussian with an exact log-prob (DPPO's DDIM fine-tuning), at ddim_steps / K of the cost.
            config = {**policy.policy_config, "sampler": "ddim", "ddim_steps": ddim_steps}
            policy = build_policy({**metadata, "policy_config": config, "ft_steps": 0}, policy.state_dict())
        elif ddim_steps is not None and policy.schedule.num_chain_steps != ddim_steps:
            raise ValueError(f"rollout_ddim_steps={ddim_steps}, but {bc_checkpoint} already runs a "
                             f"{policy.schedule.num_chain_steps}-step DDIM chain; leave it unset or equal")
        policy.enable_finetuning(ft_steps)
        return policy, metadata

    # ------------------------------------------------------------------ environments
    def make_envs(self) -> Any:
        """The vector env of all ``num_envs`` envs (env i seeded ``seed + i``); with ``env_groups > 1`` an
        :class:`~mmpo.robotics.envs.groups.EnvGroups` of one vector env per group of consecutive envs."""
        hp = self.hparams
        if hp.env_groups == 1:
            envs = self._make_vector_env(hp.num_envs, hp.seed)
        else:
            from mmpo.robotics.envs.groups import EnvGroups, group_sizes

            groups, start = [], 0
            try:
                for size in group_sizes(hp.num_envs, hp.env_groups):
                    groups.append(self._make_vector_env(size, hp.seed + start))
                    start += size
            except BaseException:
                for group in groups:
                    group.close()
                raise
            envs = EnvGroups(groups, max_worker_restarts=hp.max_env_worker_restarts)
        check_same_step_autoreset(envs)
        if envs.num_envs != hp.num_envs:
            raise ValueError(f"env factory built {envs.num_envs} envs, expected num_envs={hp.num_envs}")
        return envs

    def _make_vector_env(self, num_envs: int, seed: int) -> Any:
        """``num_envs`` envs seeded ``seed``, ``seed + 1``, ... (``env_factory`` or mmpo.robotics.envs.make_vector_env)."""
        hp = self.hparams
        if self.env_factory is not None:
            envs = self.env_factory(num_envs=num_envs, seed=seed, act_steps=self.act_steps)
        else:
            from mmpo.robotics.envs import make_vector_env

            if self.task is None:
                raise ValueError("DPPO needs a task: set model.init_args.task or use a BC checkpoint that records one")
            envs = make_vector_env(
                self.task, num_envs, seed=seed, act_steps=self.act_steps,
                normalizer_path=self.normalizer_path, max_episode_steps=self.max_episode_steps,
                asynchronous=hp.asynchronous, max_worker_restarts=hp.max_env_worker_restarts,
            )
        if envs.num_envs != num_envs:
            raise ValueError(f"env factory built {envs.num_envs} envs, expected {num_envs}")
        return envs

    def on_fit_start(self) -> None:
        if self.envs is None:
            self.envs = self.make_envs()

    def teardown(self, stage: str) -> None:
        self._prefetched_reset_seed = None
        if self.envs is not None:
            self.envs.close()
            self.envs = None

    def train_dataloader(self) -> DataLoader:
        return iteration_loader(self.hparams.num_iterations)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        hp = self.hparams
        actor = make_adamw(self.policy.ft_network.parameters(), lr=hp.actor_lr, weight_decay=hp.weight_decay)
        critic = make_adamw(self.critic.parameters(), lr=hp.critic_lr, weight_decay=hp.weight_decay)
        return [actor, critic]

    # ------------------------------------------------------------------ rollout
    def _reset_seed(self, iteration: int) -> int:
        return self.hparams.seed + 1000 * iteration if self.hparams.reset_at_iteration else self.hparams.seed

    def start_reset(self, iteration: int) -> bool:
        """Send the reset that iteration ``iteration``'s rollout starts with to the env workers and return at
        once (``prefetch_reset``); the rollout collects it. False where the envs cannot reset asynchronously.
        Safe: the reset's outcome depends only on its seed (robosuite reseeds every generator it draws from),
        not on when it runs, and nothing else uses the envs until the rollout collects it."""
        if self.envs is None or not hasattr(self.envs, "reset_async") or self._prefetched_reset_seed is not None:
            return False
        seed = self._reset_seed(iteration)
        self.envs.reset_async(seed=seed, options=self._reset_options())
        self._prefetched_reset_seed = seed
        return True

    def _reset_options(self) -> dict[str, Any] | None:
        """Options of the reset a rollout starts with: skip the autoreset after its last chunk step (see
        ``skip_final_autoreset``), which only a rollout that resets every env at its start may do."""
        hp = self.hparams
        if hp.skip_final_autoreset and hp.reset_at_iteration:
            return {SKIP_AUTORESET_AFTER: int(hp.n_steps)}
        return None

    def _collect_prefetched_reset(self) -> Any:
        """The pending prefetched reset's result (None if there is none)."""
        if self._prefetched_reset_seed is None:
            return None
        self._prefetched_reset_seed = None
        return self.envs.reset_wait()

    def _reset_envs(self) -> None:
        seed = self._reset_seed(self.iteration)
        prefetched = self._prefetched_reset_seed
        result = self._collect_prefetched_reset()
        obs, _ = (result if result is not None and prefetched == seed
                  else self.envs.reset(seed=seed, options=self._reset_options()))
        self._obs = np.asarray(obs, dtype=np.float32)
        self._episode_start = np.ones(self.hparams.num_envs, dtype=bool)
        self.train_tracker.reset()

    @torch.no_grad()
    def collect_rollout(self) -> Rollout:
        """Sample ``n_steps`` chunk steps on every env with the stochastic (training) chain."""
        hp = self.hparams
        if self._obs is None or hp.reset_at_iteration:
            self._reset_envs()
        self.policy.eval()
        lists: tuple[list[Any], ...] = tuple([] for _ in range(8))
        if getattr(self.envs, "num_groups", 1) > 1:
            self._collect_pipelined(lists)
        else:
            for _ in range(hp.n_steps):
                obs_t = torch.as_tensor(self._obs, dtype=torch.float32, device=self.device)
                actions, chain, logp = self.act(obs_t)
                self._record_step(lists, obs_t, chain, logp, self.envs.step(actions.cpu().numpy()))
        obs_l, chain_l, logp_l, rew_l, term_l, trunc_l, start_l, reached_l = lists
        return Rollout(
            obs=torch.stack(obs_l), chains=torch.stack(chain_l), old_log_probs=torch.stack(logp_l),
            rewards=torch.as_tensor(np.stack(rew_l), dtype=torch.float32),
            terminated=torch.as_tensor(np.stack(term_l)), truncated=torch.as_tensor(np.stack(trunc_l)),
            episode_start=torch.as_tensor(np.stack(start_l)),
            reached_obs=torch.as_tensor(np.stack(reached_l), dtype=torch.float32),
        )

    def _record_step(self, lists: tuple[list[Any], ...], obs_t: torch.Tensor, chain: torch.Tensor, logp: torch.Tensor,
                     step: tuple[Any, ...]) -> None:
        """Append one chunk step of all envs (obs, policy outputs, the vector env's step result) to the rollout
        lists and advance the episode bookkeeping."""
        hp = self.hparams
        obs_l, chain_l, logp_l, rew_l, term_l, trunc_l, start_l, reached_l = lists
        next_obs, rewards, terminated, truncated, infos = step
        done = np.logical_or(terminated, truncated)
        obs_l.append(obs_t.cpu())
        chain_l.append(chain.cpu())
        logp_l.append(logp.cpu())
        rew_l.append(np.asarray(rewards, dtype=np.float64) * hp.reward_scale_const)
        term_l.append(np.asarray(terminated, dtype=bool))
        trunc_l.append(np.asarray(truncated, dtype=bool))
        start_l.append(self._episode_start.copy())
        reached_l.append(final_observations(next_obs, infos, done))
        self.train_tracker.update(np.asarray(rewards), terminated, truncated, infos)
        self._obs = np.asarray(next_obs, dtype=np.float32)
        self._episode_start = done.copy()

    def _collect_pipelined(self, lists: tuple[list[Any], ...]) -> None:
        """``n_steps`` chunk steps on an :class:`~mmpo.robotics.envs.groups.EnvGroups` (``env_groups > 1``), overlapped:
        group g's actions for step t are computed while the groups before it (step t) and after it (step t - 1)
        run the simulator in their workers. Per step t: for each group, wait for its step t - 1, compute its
        actions on its rows, send them (step_async); once every group has stepped, step t - 1 is recorded over
        all envs exactly as the unpipelined loop records it. The chain noise of step t is drawn for all envs at
        once (:meth:`draw_step_noise`, the draws of one batched call) and split by rows, so each env gets the
        noise it gets with env_groups=1. The outputs are not bit-identical to env_groups=1 all the same: the
        network's matmuls run on a smaller batch, and a BLAS kernel's rounding depends on the batch size
        (differences ~1e-7; per row, log-probs are still those of the stored chain, so PPO's ratio starts at 1)."""
        hp = self.hparams
        envs = self.envs
        obs_now = [np.asarray(self._obs[part], dtype=np.float32) for part in envs.slices]
        outputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        step_results: list[tuple[Any, ...]] = []
        for step in range(hp.n_steps + 1):
            if step > 0:
                previous = outputs
            noise = self.draw_step_noise(hp.num_envs) if step < hp.n_steps else None
            outputs, step_results = [], []
            for index, part in enumerate(envs.slices):
                if step > 0:
                    result = envs.step_group_wait(index)
                    step_results.append(result)
                    obs_now[index] = np.asarray(result[0], dtype=np.float32)
                if step == hp.n_steps:
                    continue
                obs_t = torch.as_tensor(obs_now[index], dtype=torch.float32, device=self.device)
                actions, chain, logp = (self.act(obs_t) if noise is None
                                        else self.act(obs_t, noise=[draw[part] for draw in noise]))
                envs.step_group_async(index, actions.cpu().numpy())
                outputs.append((obs_t, chain, logp))
            if step > 0:
                obs_t, chain, logp = (torch.cat(parts) for parts in zip(*previous))
                self._record_step(lists, obs_t, chain, logp, envs.merge_steps(step_results))

    def draw_step_noise(self, batch: int) -> list[torch.Tensor] | None:
        """The chain noise of one chunk step on ``batch`` envs, drawn as one batched :meth:`act` would draw it
        (pipelined collection splits it by rows); None: the policy draws its own noise in :meth:`act`."""
        return self.policy.draw_chain_noise(batch, generator=self._sampling_generator(), device=self.device)

    def act(self, obs: torch.Tensor, noise: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One batched policy call on all envs' obs (N, obs_dim): the action chunks (N, Ta, Da) to execute,
        what the update re-scores (the last K'+1 chain states, (N, K'+1, Ta, Da)) and the per-step
        log-probs (N, K') (std floor, clamp, mean over executed steps and dims). ``noise``: the chain's
        standard-normal draws (:meth:`draw_step_noise` rows) instead of drawing them from the generator."""
        hp = self.hparams
        sample = self.policy.sample(
            obs, min_sampling_std=hp.min_sampling_std, noise_clip=hp.noise_clip,
            return_log_probs=True, min_logprob_std=hp.min_logprob_std, generator=self._sampling_generator(),
            noise=noise,
        )
        logp = torch.stack(
            [reduce_step_log_prob(sample.log_probs[:, i], self.act_steps, hp.logprob_min, hp.logprob_max)
             for i in range(self.policy.ft_steps)], dim=1,
        )
        return sample.actions, sample.chain, logp

    def _sampling_generator(self) -> torch.Generator | None:
        return self._generator if self.device.type == "cpu" else None

    @torch.no_grad()
    def compute_advantages(self, rollout: Rollout) -> Rollout:
        """Running reward scaling, critic values and GAE over chunk steps (mmpo.core.gae)."""
        hp = self.hparams
        rewards = rollout.rewards
        if self.reward_scaler is not None:
            scaled = self.reward_scaler(rewards.numpy(), rollout.episode_start.numpy())
            rewards = torch.as_tensor(scaled, dtype=torch.float32)
        steps, envs = rewards.shape
        values = self.critic(rollout.obs.reshape(steps * envs, -1).to(self.device)).view(steps, envs).cpu()
        next_values = self.critic(rollout.reached_obs.reshape(steps * envs, -1).to(self.device)).view(steps, envs).cpu()
        advantages, returns = gae(
            rewards, values, next_values, rollout.terminated, rollout.truncated, gamma=hp.gamma, lam=hp.gae_lambda
        )
        rollout.scaled_rewards, rollout.advantages, rollout.returns = rewards, advantages, returns
        return rollout

    # ------------------------------------------------------------------ PPO update
    def minibatch_loss(
        self,
        obs: torch.Tensor,
        chains: torch.Tensor,
        ft_index: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        returns: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one minibatch of (env step, denoising step) pairs.

        Args: obs (B, obs_dim), chains (B, K'+1, Ta, Da), ft_index (B,) in [0, K'), old_log_probs (B,),
            advantages (B,) env-level GAE, returns (B,).
        Returns: (policy loss, value loss, ratio (B,), metrics).
        """
        hp = self.hparams
        new_log_probs = self.rescore(obs, chains, ft_index)
        adv = normalize_advantages(advantages) * denoising_discount(ft_index, self.policy.ft_steps, hp.gamma_denoise).to(advantages.device)
        # one core call: each pair's PPO clip range is its denoising step's (a (B, 1) tensor bound)
        clip = self.clip_ranges[ft_index].unsqueeze(1)
        pg_loss, core_metrics = policy_loss(
            hp.loss, new_log_probs.unsqueeze(1), old_log_probs.unsqueeze(1), adv, torch.ones_like(clip),
            agg="token-mean", **dppo_loss_settings(hp.loss, clip, hp.loss_settings),
        )
        metrics = {key: core_metrics[key] for key in ("policy/clipfrac", "policy/approx_kl")}
        values = self.critic(obs)
        value_loss = 0.5 * ((values - returns) ** 2).mean()
        ratio = torch.exp((new_log_probs - old_log_probs).detach())
        return pg_loss, value_loss, ratio, metrics

    def rescore(self, obs: torch.Tensor, chains: torch.Tensor, ft_index: torch.Tensor) -> torch.Tensor:
        """Log-probs (B,) of the stored denoising steps under the current fine-tuned network."""
        hp = self.hparams
        elementwise = self.policy.chain_step_log_prob(obs, chains, ft_index, min_logprob_std=hp.min_logprob_std)
        return reduce_step_log_prob(elementwise, self.act_steps, hp.logprob_min, hp.logprob_max)

    def ppo_update(self, rollout: Rollout, train_actor: bool) -> dict[str, float]:
        """``update_epochs`` passes over shuffled (env step, denoising step) pairs through the update engine
        (``mmpo.training.update``) and the module's update wrapper (SFPO's slow-fast pass of the actor)."""
        hp = self.hparams
        actor_opt, critic_opt = self.optimizers()
        steps, envs = rollout.rewards.shape
        ft = self.policy.ft_steps
        obs = rollout.obs.reshape(steps * envs, -1).to(self.device)
        chains = rollout.chains.reshape(steps * envs, *rollout.chains.shape[2:]).to(self.device)
        old = rollout.old_log_probs.reshape(steps * envs, ft).to(self.device)
        advantages = rollout.advantages.reshape(-1).to(self.device)
        returns = rollout.returns.reshape(-1).to(self.device)
        total_pairs = steps * envs * ft
        # the last partial minibatch is skipped, as in DPPO
        schedule = UpdateSchedule(total_pairs, hp.batch_size, epochs=hp.update_epochs, drop_last=True)
        stepped = [actor_opt, critic_opt] if train_actor else [critic_opt]

        def step(epoch: int, pairs: torch.Tensor) -> dict[str, float]:
            pairs = pairs.to(self.device)
            sample_index, ft_index = pairs // ft, pairs % ft
            first_step = not pass_steps  # the ratio's drift is read on the pass's first minibatch only
            pass_steps.append(epoch)
            first = {}

            def micro_loss(_: None) -> MicroLoss:
                pg_loss, value_loss, ratio, metrics = self.minibatch_loss(
                    obs[sample_index], chains[sample_index], ft_index, old[sample_index, ft_index],
                    advantages[sample_index], returns[sample_index],
                )
                if first_step:
                    first["policy/ratio_first_minibatch_maxdev"] = float((ratio - 1).abs().max())
                # the actor's part is switched off (coefficient 0, never summed) during the critic warm-up
                parts = LossParts().add("policy", pg_loss, 1.0 if train_actor else 0.0).add("value", value_loss, hp.vf_coef)
                return MicroLoss(parts.total(), {"losses/policy": float(pg_loss.detach()),
                                                 "losses/value": float(value_loss.detach()),
                                                 "policy/clipfrac": float(metrics["policy/clipfrac"]),
                                                 "policy/approx_kl": float(metrics["policy/approx_kl"])})

            result = self.update_engine.optimizer_step([None], micro_loss, stepped=stepped)
            return {**result.metrics, **first}

        def stop(metrics: dict[str, float]) -> bool:  # target_kl ends the iteration's update early
            return hp.target_kl is not None and train_actor and metrics["policy/approx_kl"] > hp.target_kl

        pass_steps: list[int] = []

        def plain_pass() -> list[dict[str, float]]:
            pass_steps.clear()
            self.policy.train()
            history = self.update_engine.run_pass(schedule, step, generator=self._generator, stop=stop)
            self.policy.eval()
            return history

        stats = self.update_wrapper.wrap(plain_pass, self.policy.ft_network.parameters,
                                         PassContext(trains_actor=train_actor))
        keys = dict.fromkeys(key for s in stats for key in s)
        metrics = {key: float(np.mean([s[key] for s in stats if key in s])) for key in keys}
        # how much of the update ran: fewer than update_epochs x minibatches when target_kl stopped it, and
        # the drift from the rollout's policy when it ended (what target_kl is compared with)
        drift = [s["policy/approx_kl"] for s in stats if "policy/approx_kl" in s]
        metrics["policy/minibatches"] = float(len(drift))
        if drift:
            metrics["policy/approx_kl_last"] = drift[-1]
        return metrics

    # ------------------------------------------------------------------ Lightning loop
    def evaluate(self, num_episodes: int | None = None) -> dict[str, float]:
        """Deterministic evaluation with the fine-tuned network on the last K' steps (the training chain).

        Envs and the chains' initial noise are seeded by the iteration, so a resumed run evaluates alike."""
        seed = self.hparams.seed + 10_000 + self.iteration
        self._collect_prefetched_reset()  # evaluation resets the envs itself
        result = evaluate_policy(
            self.policy, self.envs, num_episodes or self.hparams.eval_episodes, deterministic=True,
            seed=seed, deterministic_sampler=self.hparams.eval_sampler, ddpm_eval_std_floor=self.hparams.eval_ddpm_std_floor,
            generator=torch.Generator(device=self.device).manual_seed(seed),
        )
        self._obs = None  # evaluation consumed the envs' episodes: the next rollout resets them
        return result

    def training_step(self, batch: Any, batch_idx: int) -> None:
        hp = self.hparams
        if self.envs is None:
            self.envs = self.make_envs()
        start = time.perf_counter()
        steps_before = self.train_tracker.env_steps
        rollout = self.collect_rollout()
        rollout_seconds = time.perf_counter() - start
        env_steps = self.train_tracker.env_steps - steps_before
        evaluating = bool(hp.eval_every) and (self.iteration % hp.eval_every == 0
                                              or self.iteration == hp.num_iterations - 1)
        if hp.prefetch_reset and hp.reset_at_iteration and not evaluating and self.iteration + 1 < hp.num_iterations:
            self.start_reset(self.iteration + 1)  # the workers reset during the update below
        self.compute_advantages(rollout)
        metrics = self.ppo_update(rollout, train_actor=self.iteration >= hp.n_critic_warmup_itr)
        summary = self.train_tracker.summary()
        self.train_tracker.returns.clear()
        self.train_tracker.successes.clear()
        self.train_tracker.lengths.clear()
        metrics.update({
            "rewards/total/mean": float(rollout.rewards.mean()),  # per chunk step, x reward_scale_const, unscaled
            "charts/return": summary["return"],
            "charts/success_rate": summary["success_rate"],
            "charts/episodes": summary["episodes"],
            "perf/env_steps_per_s": env_steps / max(rollout_seconds, 1e-9),
            "perf/env_steps_total": float(self.train_tracker.env_steps),
            "perf/faults": float(self.train_tracker.faults),
            "perf/skipped_steps": float(self.nonfinite.skipped_steps),
            "perf/env_worker_restarts": float(getattr(self.envs, "worker_restarts", 0)),
            "charts/iteration": float(self.iteration),
        })
        if evaluating:
            evaluation = self.evaluate()
            metrics.update({f"eval/{key}": value for key, value in evaluation.items()})
        self.iteration += 1
        # NaN (no finished episode this iteration, no success signal) is left out of the logs.
        clean = {key: value for key, value in metrics.items() if np.isfinite(value)}
        self.log_dict(clean, on_step=True, on_epoch=False, prog_bar=False, batch_size=1)
        self.last_metrics = metrics

    # ------------------------------------------------------------------ checkpoints
    def robotics_metadata(self) -> dict[str, Any]:
        return {
            "kind": "dppo",
            "policy_config": self.policy.policy_config,
            "policy_prefix": "policy.",
            "ft_steps": self.policy.ft_steps,
            "task": self.task,
            "act_steps": self.act_steps,
            "max_episode_steps": self.max_episode_steps,
            "normalizer_path": self.normalizer_path,
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Everything a resumed run needs to continue bit-exactly at the next iteration (weights and
        # both optimizers are Lightning's part). Envs need no state: each iteration resets them
        # with a seed derived from the iteration (reset_at_iteration; see docs/dppo.md otherwise).
        checkpoint["robotics"] = self.robotics_metadata()
        checkpoint["dppo_state"] = {
            "iteration": self.iteration,
            "generator": self._generator.get_state(),
            "rng": rng_state(),
            "env_steps": self.train_tracker.env_steps,
            "faults": self.train_tracker.faults,
        }
        if self.reward_scaler is not None:
            scaler = self.reward_scaler
            checkpoint["dppo_state"].update(
                reward_scale_mean=scaler.mean, reward_scale_var=scaler.var, reward_scale_count=scaler.count,
                reward_scale_returns=torch.as_tensor(scaler.returns),
            )

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("dppo_state", {})
        self.iteration = int(state.get("iteration", 0))
        if "generator" in state:
            self._generator.set_state(state["generator"])
            set_rng_state(state["rng"])
            self.train_tracker.env_steps = int(state["env_steps"])
            self.train_tracker.faults = int(state["faults"])
        if self.reward_scaler is not None and "reward_scale_var" in state:
            self.reward_scaler.mean = float(state["reward_scale_mean"])
            self.reward_scaler.var = float(state["reward_scale_var"])
            self.reward_scaler.count = float(state["reward_scale_count"])
            self.reward_scaler.returns = np.asarray(state["reward_scale_returns"], dtype=np.float64)
