"""Gaussian-policy PPO: the DPPO paper's main baseline (arXiv 2409.00588, section 5).

An MLP maps the observation to the mean of a Gaussian over the whole action chunk (Ta x Da) with a
learned, state-independent std floored at ``min_std``. :class:`GaussianBCModule` pre-trains the mean
on the same demos as the diffusion BC (MSE, the std is not trained there); :class:`GaussianPPOModule`
fine-tunes it with PPO + GAE on the same env interface, rollout, reward scaling, critic, checkpoint and
resume machinery as :class:`~mmpo.robotics.dppo.DPPOModule`: it is a DPPO run whose "chain" is one Gaussian
step (K' = 1), so there is no denoising discount and one PPO clip range, ``clip_coef``.

Log-probs sum over the executed chunk prefix (act_steps x Da) by default, the usual PPO likelihood of the
executed action (the diffusion policy's denoising steps use DPPO's per-dimension mean instead);
``log_prob_reduction="mean"`` averages them over those act_steps x Da entries, as the DPPO paper's Gaussian
baseline does (irom-lab/dppo ``model/rl/gaussian_vpg.py``, ``get_logprobs``: ``log_prob.mean(-1)`` and
``dist.entropy().mean()``), which puts the PPO log-ratio, clip range and approx_kl on its 1/(act_steps x Da) scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from mmpo.training.config import CriticConfig, OptimConfig, as_config
from mmpo.training.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS, NonFiniteGuard, NonFiniteGuardMixin
from mmpo.training.optim import make_adamw
from mmpo.robotics.bc import _unpack_batch
from mmpo.robotics.config import (
    GAUSSIAN_FLAT_NAMES,
    LOG_PROB_REDUCTIONS,
    DenoisingChainConfig,
    EnvConfig,
    EvalConfig,
    GaussianPolicyConfig,
    PPOLossConfig,
    ReturnsConfig,
    refuse_chain_evaluation,
)
from mmpo.robotics.dppo import DPPO_OPTIM, DPPOModule, EnvFactory
from mmpo.robotics.policy.io import _read_checkpoint
from mmpo.robotics.policy.networks import ResidualMLP

GAUSSIAN_BC_PREFIX = "policy."


def check_log_prob_reduction(reduction: str) -> str:
    if reduction not in LOG_PROB_REDUCTIONS:
        raise ValueError(f"log_prob_reduction must be one of {LOG_PROB_REDUCTIONS}, got {reduction!r}")
    return reduction


@dataclass
class GaussianSample:
    """``actions`` (B, Ta, Da), the interface of :func:`mmpo.robotics.evaluate.evaluate_policy`."""

    actions: torch.Tensor


class GaussianChunkPolicy(nn.Module):
    """obs (B, obs_dim) -> N(mean(obs), diag(std^2)) over action chunks (B, Ta, Da).

    Args:
        obs_dim, action_dim, horizon: input size, action size, chunk length Ta.
        hidden_dims, activation: the mean's ResidualMLP (as the diffusion policy's denoiser).
        init_std: initial std of every chunk entry; min_std: its floor (std = max(exp(log_std), min_std)).
    """

    def __init__(self, obs_dim: int, action_dim: int, horizon: int = 4, *, hidden_dims: list[int] | None = None,
                 activation: str = "mish", init_std: float = 0.1, min_std: float = 0.01) -> None:
        super().__init__()
        if not 0 < min_std <= init_std:
            raise ValueError(f"need 0 < min_std <= init_std, got min_std={min_std}, init_std={init_std}")
        self.obs_dim, self.action_dim, self.horizon, self.min_std = obs_dim, action_dim, horizon, min_std
        self.policy_config = dict(obs_dim=obs_dim, action_dim=action_dim, horizon=horizon,
                                  hidden_dims=list(hidden_dims or (512, 512, 512)), activation=activation,
                                  init_std=init_std, min_std=min_std)
        self.mean_net = ResidualMLP(obs_dim, self.policy_config["hidden_dims"], horizon * action_dim, activation)
        self.log_std = nn.Parameter(torch.full((horizon, action_dim), math.log(init_std)))
        self.ft_steps = 1  # the DPPO update's view: one "denoising step" per env step

    @property
    def ft_network(self) -> nn.Module:
        """What PPO trains: the whole policy (DPPOModule's optimizer and clipping read this name)."""
        return self

    def mean(self, obs: torch.Tensor) -> torch.Tensor:
        return self.mean_net(obs).view(obs.shape[0], self.horizon, self.action_dim)

    def std(self) -> torch.Tensor:
        """(Ta, Da) std, floored so the PPO ratio stays bounded."""
        return self.log_std.exp().clamp_min(self.min_std)

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor, act_steps: int, reduction: str = "sum") -> torch.Tensor:
        """log N(actions | mean(obs), std^2) over the executed prefix (act_steps, Da), summed (``reduction="sum"``)
        or averaged per entry (``"mean"``, the DPPO paper's Gaussian baseline): (B,)."""
        check_log_prob_reduction(reduction)
        dist = torch.distributions.Normal(self.mean(obs)[:, :act_steps], self.std()[:act_steps])
        elementwise = dist.log_prob(actions[:, :act_steps])
        return elementwise.sum(dim=(1, 2)) if reduction == "sum" else elementwise.mean(dim=(1, 2))

    def entropy(self, act_steps: int, reduction: str = "sum") -> torch.Tensor:
        """Entropy of the executed prefix: 0.5 * log(2 pi e) + log std per entry (state-independent std), summed
        or averaged over the act_steps x Da entries as ``reduction`` says (as :meth:`log_prob`)."""
        check_log_prob_reduction(reduction)
        entries = torch.distributions.Normal(torch.zeros(()), self.std()[:act_steps]).entropy()
        return entries.sum() if reduction == "sum" else entries.mean()

    def sample(self, obs: torch.Tensor, *, deterministic: bool = False, noise_clip: float | None = None,
               generator: torch.Generator | None = None, **_diffusion_only: Any) -> GaussianSample:
        """Mean (deterministic) or mean + std * eps, eps clipped to [-noise_clip, noise_clip] as DPPO does.
        The diffusion samplers' settings (evaluate_policy passes them) do not apply and are ignored."""
        mean = self.mean(obs)
        if deterministic:
            return GaussianSample(mean)
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        if noise_clip is not None:
            noise = noise.clamp(-noise_clip, noise_clip)
        return GaussianSample(mean + self.std() * noise)


def load_gaussian_policy(path: str | Path) -> tuple[GaussianChunkPolicy, dict[str, Any]]:
    """(policy in eval mode, metadata) from a :class:`GaussianBCModule` or :class:`GaussianPPOModule` ``.ckpt``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"policy checkpoint {path} does not exist")
    checkpoint = _read_checkpoint(path, lambda p: torch.load(p, map_location="cpu", weights_only=True))
    metadata = dict(checkpoint.get("robotics", {}))
    if metadata.get("kind") not in ("gaussian_bc", "gaussian_ppo"):
        raise ValueError(f"{path} is not a Gaussian policy checkpoint (robotics kind {metadata.get('kind')!r}); "
                         "pre-train with configs/robotics/gaussian_bc_lift.yaml")
    prefix = metadata["policy_prefix"]
    state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    policy = GaussianChunkPolicy(**metadata["policy_config"])
    policy.load_state_dict(state, strict=True)
    return policy.eval(), metadata


class GaussianBCModule(NonFiniteGuardMixin, pl.LightningModule):
    """Behaviour cloning of the Gaussian policy's mean (MSE on the whole chunk) on a ChunkDataModule.

    Args: obs_dim, action_dim, horizon, hidden_dims, activation, init_std, min_std: the policy;
        lr, weight_decay: AdamW; max_consecutive_skips: non-finite steps skipped in a row before the run stops;
        task, act_steps, max_episode_steps, normalizer_path: env settings
        stored in the checkpoint for :class:`GaussianPPOModule` (normalizer_path default: the datamodule's).
    """

    def __init__(self, obs_dim: int, action_dim: int, horizon: int = 4, *, hidden_dims: list[int] | None = None,
                 activation: str = "mish", init_std: float = 0.1, min_std: float = 0.01, lr: float = 1e-3,
                 weight_decay: float = 1e-6, task: str = "lift", act_steps: int = 4,
                 max_episode_steps: int | None = None, normalizer_path: str | None = None,
                 max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS) -> None:
        super().__init__()
        self.save_hyperparameters()
        # a NaN/inf loss or gradient skips the step (weights untouched), as in BCModule (mmpo.training.nonfinite)
        self.nonfinite = NonFiniteGuard(max_consecutive_skips)
        if not 1 <= act_steps <= horizon:
            raise ValueError(f"act_steps must be in [1, horizon={horizon}], got {act_steps}")
        self.policy = GaussianChunkPolicy(obs_dim, action_dim, horizon, hidden_dims=hidden_dims, activation=activation,
                                          init_std=init_std, min_std=min_std)

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and self.hparams.normalizer_path is None:
            self.hparams.normalizer_path = getattr(datamodule, "normalizer_path", None)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        obs, actions = _unpack_batch(batch)
        loss = ((self.policy.mean(obs) - actions) ** 2).mean()
        self.log("losses/bc", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=obs.shape[0])
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_adamw(self.policy.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    def robotics_metadata(self) -> dict[str, Any]:
        hp = self.hparams
        return {"kind": "gaussian_bc", "policy_config": self.policy.policy_config, "policy_prefix": GAUSSIAN_BC_PREFIX,
                "task": hp.task, "act_steps": hp.act_steps, "max_episode_steps": hp.max_episode_steps,
                "normalizer_path": hp.normalizer_path}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["robotics"] = self.robotics_metadata()


class GaussianPPOModule(DPPOModule):
    """PPO + GAE fine-tuning of a :class:`GaussianBCModule` checkpoint (DPPO's Gaussian baseline).

    A :class:`~mmpo.robotics.dppo.DPPOModule` whose "chain" is one Gaussian step: it takes DPPO's groups but
    ``chain`` (built here: K' = 1, one clip range ``gaussian.clip_coef``), and its own ``gaussian`` group.

    Args:
        bc_checkpoint: a Gaussian BC (or Gaussian PPO) ``.ckpt``.
        num_iterations: PPO iterations (rollout + update).
        gaussian: the policy step (:class:`~mmpo.robotics.config.GaussianPolicyConfig`: clip_coef = the PPO clip
            range of the ratio, ent_coef = entropy bonus on the executed chunk's Gaussian entropy, log_prob_reduction
            "sum" (default) or "mean" over the executed chunk's act_steps x Da entries (the DPPO paper's Gaussian
            baseline: log-ratio, clip range and approx_kl on a 1/(act_steps x Da) scale), noise_clip).
        env, returns, loss, optim, critic, evaluation, seed, env_factory, max_consecutive_skips: as
            :class:`~mmpo.robotics.dppo.DPPOModule` (``optim.minibatch_size`` counts env steps here); the
            evaluation's ``sampler`` and ``ddpm_std_floor`` are denoising-chain settings and must stay unset.
    """

    config_groups = ("env", "returns", "loss", "optim", "critic", "evaluation", "gaussian")
    flat_names = GAUSSIAN_FLAT_NAMES

    def __init__(
        self,
        bc_checkpoint: str,
        num_iterations: int = 81,
        *,
        gaussian: GaussianPolicyConfig = GaussianPolicyConfig(),
        env: EnvConfig = EnvConfig(),
        returns: ReturnsConfig = ReturnsConfig(),
        loss: PPOLossConfig = PPOLossConfig(),
        optim: OptimConfig = DPPO_OPTIM,
        critic: CriticConfig = CriticConfig(),
        evaluation: EvalConfig = EvalConfig(),
        seed: int = 0,
        env_factory: EnvFactory | None = None,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
    ) -> None:
        self.gaussian = as_config(gaussian, GaussianPolicyConfig())
        evaluation = as_config(evaluation, EvalConfig())
        refuse_chain_evaluation(evaluation, "are denoising-chain settings of DPPO; the Gaussian policy has none")
        clip = self.gaussian.clip_coef
        chain = DenoisingChainConfig(ft_steps=1, clip_base=clip, clip_final=clip, noise_clip=self.gaussian.noise_clip)
        super().__init__(bc_checkpoint, num_iterations, env=env, chain=chain, returns=returns, loss=loss, optim=optim,
                         critic=critic, evaluation=evaluation, seed=seed, env_factory=env_factory,
                         max_consecutive_skips=max_consecutive_skips)
        self.hparams.pop("chain", None)  # built from ``gaussian``, not an init argument here

    def load_actor(self, bc_checkpoint: str, ft_steps: int) -> tuple[GaussianChunkPolicy, dict[str, Any]]:
        return load_gaussian_policy(bc_checkpoint)

    def act(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sampled chunks (N, Ta, Da), stored as the "chain" (what the update re-scores), and log-probs (N, 1)."""
        actions = self.policy.sample(obs, noise_clip=self.gaussian.noise_clip, generator=self._sampling_generator()).actions
        reduction = self.gaussian.log_prob_reduction
        return actions, actions, self.policy.log_prob(obs, actions, self.act_steps, reduction).unsqueeze(1)

    def draw_step_noise(self, batch: int) -> None:
        """None: with ``env_groups > 1`` each group's :meth:`act` draws its own noise (a valid rollout, but not
        the random stream of ``env_groups=1``)."""
        return None

    def rescore(self, obs: torch.Tensor, chains: torch.Tensor, ft_index: torch.Tensor) -> torch.Tensor:
        return self.policy.log_prob(obs, chains, self.act_steps, self.gaussian.log_prob_reduction)

    def minibatch_loss(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        pg_loss, value_loss, ratio, metrics = super().minibatch_loss(*args)
        if self.gaussian.ent_coef:
            pg_loss = pg_loss - self.gaussian.ent_coef * self.policy.entropy(self.act_steps,
                                                                           self.gaussian.log_prob_reduction)
        return pg_loss, value_loss, ratio, metrics

    def robotics_metadata(self) -> dict[str, Any]:
        return {**super().robotics_metadata(), "kind": "gaussian_ppo", "ft_steps": 0}
