"""DPPO: PPO fine-tuning of a diffusion policy through its denoising MDP (arXiv 2409.00588).

Each env step's K-step denoising chain is a sequence of Gaussian policy steps with exact
log-likelihoods. A frozen copy of the pre-trained (BC) network runs the first K - K' chain
steps, a trainable copy (initialised from it) the last K'. One ``training_step`` of
:class:`DPPOModule` is one DPPO iteration:

1. roll out ``env.n_steps`` chunk steps on ``env.num_envs`` vectorised envs, sampling with the std
   floor (0.1) and noise clip (3) on every denoising step, storing the last K'+1 chain states
   and the per-step log-probs (std floor 0.1, clamp [-5, 2], mean over executed steps and dims);
2. running reward scaling, then GAE over chunk steps through :func:`mmpo.core.gae`
   (terminations stop bootstrapping, truncations bootstrap from V(final obs));
3. ``optim.mu`` passes of minibatches of ``optim.minibatch_size`` (env step, denoising step) pairs:
   advantages normalised per minibatch and multiplied by gamma_denoise^(K'-1-i), the PPO clip loss of
   :func:`mmpo.core.policy_loss` (``loss.name``: ``ppo``, or another loss of :data:`DPPO_LOSSES`) with the
   exponential per-denoising-step clip range, critic MSE
   with coefficient ``critic.vf_coef``; the actor is not stepped during ``critic.warmup_iterations``;
4. every ``evaluation.every`` iterations a deterministic evaluation with the fine-tuned network.

Metrics: ``charts/return``, ``charts/success_rate`` (finished training episodes),
``eval/return``, ``eval/success_rate``, ``losses/policy``, ``losses/value``, ``policy/clipfrac``,
``policy/approx_kl``, ``perf/env_steps_per_s``, ``perf/faults``, ``perf/env_worker_restarts``.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from mmpo.algos.config import rng_state, set_rng_state
from mmpo.core import POLICY_LOSSES, gae, policy_loss
from mmpo.core import LossParts
from mmpo.training.config import CriticConfig, OptimConfig, as_config
from mmpo.training.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS, NonFiniteGuard, NonFiniteGuardMixin
from mmpo.training.update import MicroLoss, PassContext, UpdateEngine, UpdateSchedule, UpdateWrapper
from mmpo.training.update import micro_batch_metrics
from mmpo.training.optim import make_adamw
from mmpo.robotics.config import (
    DPPO_FLAT_NAMES,
    DenoisingChainConfig,
    EnvConfig,
    EvalConfig,
    PPOLossConfig,
    ReturnsConfig,
    grouped_hparams,
    has_flat_hparams,
)
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

DPPO_OPTIM = OptimConfig(lr=1e-4, weight_decay=0.0, max_grad_norm=0.0, mu=10, minibatch_size=7500)
"""DPPO's actor optimizer and update loop: AdamW lr 1e-4, no gradient clipping, 10 passes of 7500 pairs."""

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
        raise ValueError(f"loss.settings {clash} are set by the per-denoising-step clip range (chain.clip_base, "
                         f"chain.clip_final, chain.clip_rate); remove them")
    one = torch.zeros(1, 1)
    policy_loss(loss, one, one, one[:, 0], torch.ones(1, 1), **dppo_loss_settings(loss, one + 0.1, loss_settings))


def check_update_settings(optim: OptimConfig) -> None:
    """Fail for the OptimConfig fields DPPO's update does not have: it runs minibatches whole
    (no micro-batches) at a constant learning rate, and needs a minibatch size."""
    if optim.minibatch_size is None:
        raise ValueError("optim.minibatch_size must be set: (env step, denoising step) pairs per minibatch")
    unused = {name: getattr(optim, name) for name, default in (("warmup_steps", 0), ("lr_schedule", "constant"),
                                                                ("micro_batch_size", None))
              if getattr(optim, name) != default}
    if unused:
        raise ValueError(f"optim {sorted(unused)} do not apply to DPPO's update (constant lr, whole minibatches); "
                         f"remove them")


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

    The settings are grouped in frozen dataclasses (mmpo.robotics.config, mmpo.training.config), nested under
    ``model.init_args`` in a config (``--model.init_args.optim.lr=1e-5`` on the command line); docs/dppo.md has
    the flat name each field had before.

    Args:
        bc_checkpoint: BC checkpoint (``.ckpt`` from ``mmpo fit -c configs/robotics/bc_*.yaml`` or
            ``policy.safetensors``); its EMA policy becomes the frozen base and the fine-tuned copy.
        num_iterations: DPPO iterations (rollout + update) of the fit.
        env: the vector env and the rollout (:class:`~mmpo.robotics.config.EnvConfig`: task, act_steps,
            max_episode_steps, normalizer_path (default: the checkpoint's), num_envs, n_steps (lift: 50, 300),
            reset_at_iteration, skip_final_autoreset, asynchronous, env_groups, prefetch_reset, max_worker_restarts).
            ``env_groups`` > 1 pipelines the collection (envs split into groups of consecutive envs, one vector
            env each, mmpo.robotics.envs.groups.EnvGroups; the rollout equals env_groups=1's up to float
            rounding); ``prefetch_reset`` overlaps the next iteration's reset with the update; env workers that
            die are restarted up to ``max_worker_restarts`` times (``perf/env_worker_restarts``) before the run
            stops with an error naming the worker and its env.
        chain: the fine-tuned denoising chain (:class:`~mmpo.robotics.config.DenoisingChainConfig`: ft_steps K'
            (10 of K = 20), gamma_denoise (0.99), the per-denoising-step clip range clip_base -> clip_final at
            clip_rate (0.001 -> 0.01, 3), DPPO's floors and clips min_sampling_std, noise_clip, min_logprob_std
            (0.1, 3, 0.1), the log-prob clamp logprob_min, logprob_max (-5, 2) and rollout_ddim_steps (None: the
            BC policy's own DDPM chain; n: a DDIM eta = 1 chain of n strided steps, DPPO's DDIM fine-tuning)).
        returns: reward scaling and GAE over chunk steps (:class:`~mmpo.robotics.config.ReturnsConfig`: gamma,
            lam (robomimic 0.999, 0.95), reward_scale_running, reward_scale_const, reward_scale_gamma (0.99)).
        loss: the actor's loss (:class:`~mmpo.robotics.config.PPOLossConfig`: name 'ppo' (DPPO's), or 'gppo',
            'cispo', 'aspo' (their clip_low / clip_high are the per-denoising-step clip range), 'sapo', 'gpg';
            settings (not the clip bounds); target_kl (1.0; None = never stop early)).
        optim: the actor's AdamW and the update loop (:class:`~mmpo.training.config.OptimConfig`: lr (1e-4),
            weight_decay (0, the critic's too), max_grad_norm (0 = no clipping, as DPPO; actor and critic are
            clipped separately), mu = passes over the rollout per iteration (10), minibatch_size = (env step,
            denoising step) pairs per minibatch (lift 7500; the last partial one is skipped)). DPPO has no
            learning-rate schedule and no micro-batches: warmup_steps, lr_schedule and micro_batch_size keep
            their defaults.
        critic: the value function (:class:`~mmpo.training.config.CriticConfig`: lr (1e-3), vf_coef (0.5),
            warmup_iterations = first iterations that train only the critic (robomimic 2), hidden_dims of its
            ResidualMLP ([256, 256, 256])).
        evaluation: deterministic evaluation (:class:`~mmpo.robotics.config.EvalConfig`: every (0 = never),
            episodes, sampler (None: the policy's DDPM chain; "ddim": DDIM eta = 0), ddpm_std_floor (None: step
            means, the results in bench/RESULTS.md; 1e-3: the official DPPO evaluation)).
        seed: env seed (env i: seed + i) and torch seed of sampling.
        env_factory: callable ``(num_envs=..., seed=..., act_steps=...) -> VectorEnv`` (SAME_STEP
            autoreset) replacing ``mmpo.robotics.envs.make_vector_env`` (used by tests).
        max_consecutive_skips: minibatch steps with a non-finite loss or gradient norm are skipped (actor, critic
            and optimizer states untouched, counted as perf/skipped_steps); this many in a row stop the run with
            NonFiniteTrainingError (mmpo.training.nonfinite).
    """

    config_groups: tuple[str, ...] = ("env", "chain", "returns", "loss", "optim", "critic", "evaluation")
    """Attributes holding the module's config dataclasses; they go into hparams (and checkpoints) as plain dicts."""

    flat_names: dict[str, tuple[str, str]] = DPPO_FLAT_NAMES
    """The module's flat init arguments before the groups (old name -> (group, field)), for old checkpoints."""

    def __init__(
        self,
        bc_checkpoint: str,
        num_iterations: int = 81,
        *,
        env: EnvConfig = EnvConfig(),
        chain: DenoisingChainConfig = DenoisingChainConfig(),
        returns: ReturnsConfig = ReturnsConfig(),
        loss: PPOLossConfig = PPOLossConfig(),
        optim: OptimConfig = DPPO_OPTIM,
        critic: CriticConfig = CriticConfig(),
        evaluation: EvalConfig = EvalConfig(),
        seed: int = 0,
        env_factory: EnvFactory | None = None,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["env_factory"])
        self.env = as_config(env, EnvConfig())
        self.chain = as_config(chain, DenoisingChainConfig())
        self.returns = as_config(returns, ReturnsConfig())
        self.loss = as_config(loss, PPOLossConfig())
        self.optim = as_config(optim, DPPO_OPTIM)
        self.critic_config = as_config(critic, CriticConfig())
        self.evaluation = as_config(evaluation, EvalConfig())
        for name in self.config_groups:
            self.hparams[name] = dataclasses.asdict(self._config_group(name))
        self.automatic_optimization = False
        self.nonfinite = NonFiniteGuard(max_consecutive_skips)
        if int(num_iterations) < 1:
            raise ValueError(f"num_iterations must be >= 1, got {num_iterations}")
        check_update_settings(self.optim)
        check_dppo_loss(self.loss.name, self.loss.settings)
        chain_config = self.chain
        policy, metadata = self.load_actor(bc_checkpoint, chain_config.ft_steps)
        self.source_metadata = metadata
        self.task = self.env.task or metadata.get("task")
        self.act_steps = int(self.env.act_steps or metadata.get("act_steps") or policy.horizon)
        if not 1 <= self.act_steps <= policy.horizon:
            raise ValueError(f"act_steps must be in [1, horizon={policy.horizon}], got {self.act_steps}")
        self.max_episode_steps = self.env.max_episode_steps or metadata.get("max_episode_steps")
        self.normalizer_path = self.env.normalizer_path or metadata.get("normalizer_path")
        self.policy: DiffusionPolicy = policy
        self.critic = CriticMLP(policy.obs_dim, self.critic_config.hidden_dims or [256, 256, 256],
                                image_encoder=policy.policy_config.get("image_encoder"))
        self.register_buffer("clip_ranges", clip_schedule(chain_config.ft_steps, chain_config.clip_base,
                                                          chain_config.clip_final, chain_config.clip_rate),
                             persistent=False)
        self.env_factory = env_factory
        self.envs: Any = None
        num_envs = self.env.num_envs
        self.reward_scaler = (RunningRewardScaler(num_envs, gamma=self.returns.reward_scale_gamma)
                              if self.returns.reward_scale_running else None)
        self._obs: np.ndarray | None = None
        self._episode_start: np.ndarray | None = None
        self._prefetched_reset_seed: int | None = None  # the seed of a reset sent to the workers, not yet collected
        self.train_tracker = EpisodeTracker(num_envs)
        self.iteration = 0
        self._generator = torch.Generator().manual_seed(seed)
        # DPPO clips the actor's and the critic's gradient norms separately (0: no clipping, as DPPO)
        self.update_engine = UpdateEngine(
            self, max_grad_norm=self.optim.max_grad_norm,
            clip_groups=lambda: [list(self.policy.ft_network.parameters()), list(self.critic.parameters())])
        # how a whole update pass runs: as is, or wrapped by a variant (SFPO's slow-fast pass of the actor)
        self.update_wrapper: UpdateWrapper = UpdateWrapper()

    def _config_group(self, name: str) -> Any:
        """The config dataclass of init argument ``name`` (``critic`` is kept as ``critic_config``: ``critic``
        is the value network)."""
        return self.critic_config if name == "critic" else getattr(self, name)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> "DPPOModule":
        """Lightning's ``load_from_checkpoint``; a checkpoint saved before the config groups (flat
        ``actor_lr``, ``update_epochs``, ...) has its hyperparameters moved into the groups first
        (:func:`~mmpo.robotics.config.grouped_hparams`), so it builds the module it was saved from."""
        if isinstance(checkpoint_path, (str, Path)):
            checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
            saved = checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_KEY) or {}
            if has_flat_hparams(saved, cls.flat_names):
                checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = grouped_hparams(saved, cls.flat_names)
                buffer = io.BytesIO()
                torch.save(checkpoint, buffer)
                buffer.seek(0)
                checkpoint_path = buffer
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    def load_actor(self, bc_checkpoint: str, ft_steps: int) -> tuple[Any, dict[str, Any]]:
        """The policy to fine-tune and its checkpoint's metadata: the BC diffusion policy with a trainable
        copy of its last ``ft_steps`` denoising steps (a subclass loads another policy family)."""
        policy, metadata = load_policy(bc_checkpoint)
        ddim_steps = self.chain.rollout_ddim_steps
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
        env, seed = self.env, self.hparams.seed
        if env.env_groups == 1:
            envs = self._make_vector_env(env.num_envs, seed)
        else:
            from mmpo.robotics.envs.groups import EnvGroups, group_sizes

            groups, start = [], 0
            try:
                for size in group_sizes(env.num_envs, env.env_groups):
                    groups.append(self._make_vector_env(size, seed + start))
                    start += size
            except BaseException:
                for group in groups:
                    group.close()
                raise
            envs = EnvGroups(groups, max_worker_restarts=env.max_worker_restarts)
        check_same_step_autoreset(envs)
        if envs.num_envs != env.num_envs:
            raise ValueError(f"env factory built {envs.num_envs} envs, expected num_envs={env.num_envs}")
        return envs

    def _make_vector_env(self, num_envs: int, seed: int) -> Any:
        """``num_envs`` envs seeded ``seed``, ``seed + 1``, ... (``env_factory`` or mmpo.robotics.envs.make_vector_env)."""
        if self.env_factory is not None:
            envs = self.env_factory(num_envs=num_envs, seed=seed, act_steps=self.act_steps)
        else:
            from mmpo.robotics.envs import make_vector_env

            if self.task is None:
                raise ValueError("DPPO needs a task: set model.init_args.task or use a BC checkpoint that records one")
            envs = make_vector_env(
                self.task, num_envs, seed=seed, act_steps=self.act_steps,
                normalizer_path=self.normalizer_path, max_episode_steps=self.max_episode_steps,
                asynchronous=self.env.asynchronous, max_worker_restarts=self.env.max_worker_restarts,
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
        actor = make_adamw(self.policy.ft_network.parameters(), lr=self.optim.lr, weight_decay=self.optim.weight_decay)
        critic = make_adamw(self.critic.parameters(), lr=self.critic_config.lr, weight_decay=self.optim.weight_decay)
        return [actor, critic]

    # ------------------------------------------------------------------ rollout
    def _reset_seed(self, iteration: int) -> int:
        return self.hparams.seed + 1000 * iteration if self.env.reset_at_iteration else self.hparams.seed

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
        if self.env.skip_final_autoreset and self.env.reset_at_iteration:
            return {SKIP_AUTORESET_AFTER: int(self.env.n_steps)}
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
        self._episode_start = np.ones(self.env.num_envs, dtype=bool)
        self.train_tracker.reset()

    @torch.no_grad()
    def collect_rollout(self) -> Rollout:
        """Sample ``n_steps`` chunk steps on every env with the stochastic (training) chain."""
        if self._obs is None or self.env.reset_at_iteration:
            self._reset_envs()
        self.policy.eval()
        lists: tuple[list[Any], ...] = tuple([] for _ in range(8))
        if getattr(self.envs, "num_groups", 1) > 1:
            self._collect_pipelined(lists)
        else:
            for _ in range(self.env.n_steps):
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
        obs_l, chain_l, logp_l, rew_l, term_l, trunc_l, start_l, reached_l = lists
        next_obs, rewards, terminated, truncated, infos = step
        done = np.logical_or(terminated, truncated)
        obs_l.append(obs_t.cpu())
        chain_l.append(chain.cpu())
        logp_l.append(logp.cpu())
        rew_l.append(np.asarray(rewards, dtype=np.float64) * self.returns.reward_scale_const)
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
        n_steps = self.env.n_steps
        envs = self.envs
        obs_now = [np.asarray(self._obs[part], dtype=np.float32) for part in envs.slices]
        outputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        step_results: list[tuple[Any, ...]] = []
        for step in range(n_steps + 1):
            if step > 0:
                previous = outputs
            noise = self.draw_step_noise(self.env.num_envs) if step < n_steps else None
            outputs, step_results = [], []
            for index, part in enumerate(envs.slices):
                if step > 0:
                    result = envs.step_group_wait(index)
                    step_results.append(result)
                    obs_now[index] = np.asarray(result[0], dtype=np.float32)
                if step == n_steps:
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
        chain = self.chain
        sample = self.policy.sample(
            obs, min_sampling_std=chain.min_sampling_std, noise_clip=chain.noise_clip,
            return_log_probs=True, min_logprob_std=chain.min_logprob_std, generator=self._sampling_generator(),
            noise=noise,
        )
        logp = torch.stack(
            [reduce_step_log_prob(sample.log_probs[:, i], self.act_steps, chain.logprob_min, chain.logprob_max)
             for i in range(self.policy.ft_steps)], dim=1,
        )
        return sample.actions, sample.chain, logp

    def _sampling_generator(self) -> torch.Generator | None:
        return self._generator if self.device.type == "cpu" else None

    @torch.no_grad()
    def compute_advantages(self, rollout: Rollout) -> Rollout:
        """Running reward scaling, critic values and GAE over chunk steps (mmpo.core.gae)."""
        rewards = rollout.rewards
        if self.reward_scaler is not None:
            scaled = self.reward_scaler(rewards.numpy(), rollout.episode_start.numpy())
            rewards = torch.as_tensor(scaled, dtype=torch.float32)
        steps, envs = rewards.shape
        values = self.critic(rollout.obs.reshape(steps * envs, -1).to(self.device)).view(steps, envs).cpu()
        next_values = self.critic(rollout.reached_obs.reshape(steps * envs, -1).to(self.device)).view(steps, envs).cpu()
        advantages, returns = gae(
            rewards, values, next_values, rollout.terminated, rollout.truncated, gamma=self.returns.gamma,
            lam=self.returns.lam,
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
        new_log_probs = self.rescore(obs, chains, ft_index)
        discount = denoising_discount(ft_index, self.policy.ft_steps, self.chain.gamma_denoise)
        adv = normalize_advantages(advantages) * discount.to(advantages.device)
        # one core call: each pair's PPO clip range is its denoising step's (a (B, 1) tensor bound)
        clip = self.clip_ranges[ft_index].unsqueeze(1)
        pg_loss, core_metrics = policy_loss(
            self.loss.name, new_log_probs.unsqueeze(1), old_log_probs.unsqueeze(1), adv, torch.ones_like(clip),
            agg="token-mean", **dppo_loss_settings(self.loss.name, clip, self.loss.settings),
        )
        metrics = {key: core_metrics[key] for key in ("policy/clipfrac", "policy/approx_kl")}
        values = self.critic(obs)
        value_loss = 0.5 * ((values - returns) ** 2).mean()
        ratio = torch.exp((new_log_probs - old_log_probs).detach())
        return pg_loss, value_loss, ratio, metrics

    def rescore(self, obs: torch.Tensor, chains: torch.Tensor, ft_index: torch.Tensor) -> torch.Tensor:
        """Log-probs (B,) of the stored denoising steps under the current fine-tuned network."""
        chain = self.chain
        elementwise = self.policy.chain_step_log_prob(obs, chains, ft_index, min_logprob_std=chain.min_logprob_std)
        return reduce_step_log_prob(elementwise, self.act_steps, chain.logprob_min, chain.logprob_max)

    def ppo_update(self, rollout: Rollout, train_actor: bool) -> dict[str, float]:
        """``optim.mu`` passes over shuffled (env step, denoising step) pairs through the update engine
        (``mmpo.training.update``) and the module's update wrapper (SFPO's slow-fast pass of the actor)."""
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
        schedule = UpdateSchedule(total_pairs, self.optim.minibatch_size, epochs=self.optim.mu, drop_last=True)
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
                parts = (LossParts().add("policy", pg_loss, 1.0 if train_actor else 0.0)
                         .add("value", value_loss, self.critic_config.vf_coef))
                loss = parts.total()
                return MicroLoss(loss, micro_batch_metrics(parts, loss, metrics, single_micro_batch=True))

            result = self.update_engine.optimizer_step([None], micro_loss, stepped=stepped)
            return {**result.metrics, **first}

        def stop(metrics: dict[str, float]) -> bool:  # target_kl ends the iteration's update early
            target_kl = self.loss.target_kl
            return target_kl is not None and train_actor and metrics["policy/approx_kl"] > target_kl

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
        # how much of the update ran: fewer than optim.mu x minibatches when target_kl stopped it, and
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
            self.policy, self.envs, num_episodes or self.evaluation.episodes, deterministic=True, seed=seed,
            deterministic_sampler=self.evaluation.sampler, ddpm_eval_std_floor=self.evaluation.ddpm_std_floor,
            generator=torch.Generator(device=self.device).manual_seed(seed),
        )
        self._obs = None  # evaluation consumed the envs' episodes: the next rollout resets them
        return result

    def training_step(self, batch: Any, batch_idx: int) -> None:
        num_iterations, every = self.hparams.num_iterations, self.evaluation.every
        if self.envs is None:
            self.envs = self.make_envs()
        start = time.perf_counter()
        steps_before = self.train_tracker.env_steps
        rollout = self.collect_rollout()
        rollout_seconds = time.perf_counter() - start
        env_steps = self.train_tracker.env_steps - steps_before
        evaluating = bool(every) and (self.iteration % every == 0 or self.iteration == num_iterations - 1)
        if (self.env.prefetch_reset and self.env.reset_at_iteration and not evaluating
                and self.iteration + 1 < num_iterations):
            self.start_reset(self.iteration + 1)  # the workers reset during the update below
        self.compute_advantages(rollout)
        metrics = self.ppo_update(rollout, train_actor=self.iteration >= self.critic_config.warmup_iterations)
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
