"""FPO: Flow Policy Optimization, PPO with a flow-matching-loss surrogate of the likelihood ratio (arXiv 2507.21053).

A flow policy's action likelihood is intractable; FPO replaces the PPO ratio with
rho = exp(mean_j L_old(a | s; tau_j, eps_j) - mean_j L_new(a | s; tau_j, eps_j)), where L is the per-sample
conditional flow matching loss of the sampled action chunk a under M (noise, time) draws fixed at rollout time and
shared by the old and the new policy (akanazawa/fpo ``playground/src/flow_policy/fpo.py``: ``_compute_cfm_loss``,
``_compute_fpo_loss`` with ``average_losses_before_exp``). The ratio is PPO-clipped (0.05) by the core ``ppo`` loss:
FPO's "log-prob" of a chunk is -mean_j L_j, so exp(new - old) is exactly FPO's rho. Actions are sampled by the
plain K-step Euler flow from x_0 ~ N(0, I) (FPO: ``sde_sigma`` 0, ``feather_std`` 0).

:class:`FPOModule` is a :class:`~mmpo.robotics.dppo.DPPOModule` with one ratio per env step (K' = 1 in the DPPO
update's view): the same vector envs, rollout, reward scaling, critic, GAE, shared update engine, target-KL stop,
checkpoints and bit-exact resume. Each env step stores the chunk, its M noise draws and M times (the "chain"
tensor (N, 1 + 2M, Ta, Da): the chunk, the draws, then each time broadcast over (Ta, Da)) and -mean_j L_old.
"""

from __future__ import annotations

from typing import Any

import torch

from mmpo.robotics.config import DenoisingChainConfig, EnvConfig, EvalConfig, FPOConfig, PPOLossConfig, ReturnsConfig
from mmpo.robotics.dppo import DPPOModule, EnvFactory
from mmpo.robotics.policy.flow import FlowPolicy, euler_times
from mmpo.robotics.reinflow import check_no_chain_eval, load_flow_policy
from mmpo.training.config import CriticConfig, OptimConfig, as_config
from mmpo.training.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS

FPO_OPTIM = OptimConfig(lr=1e-4, weight_decay=0.0, max_grad_norm=0.0, mu=10, minibatch_size=500)
"""FPO has no robomimic configuration; the actor update is DPPO's robomimic one (lr 1e-4, 10 epochs, no clipping),
with minibatches of 500 env steps (one ratio per env step, as ReinFlow's 500)."""


def pack_fpo_sample(actions: torch.Tensor, eps: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """(N, 1 + 2M, Ta, Da): the chunk (N, Ta, Da), its M draws (N, M, Ta, Da), the M times (N, M) broadcast."""
    return torch.cat([actions.unsqueeze(1), eps, tau[..., None, None].expand_as(eps)], dim=1)


def unpack_fpo_sample(stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_fpo_sample`: (actions, eps, tau)."""
    samples = (stored.shape[1] - 1) // 2
    return stored[:, 0], stored[:, 1:1 + samples], stored[:, 1 + samples:, 0, 0]


class FPOModule(DPPOModule):
    """FPO fine-tuning of a flow BC checkpoint (:class:`~mmpo.robotics.flow_bc.FlowBCModule`).

    Args:
        bc_checkpoint: a flow BC (or FPO) ``.ckpt`` / ``policy.safetensors``; its EMA velocity network is copied and
            trained (the BC network stays frozen, unused).
        num_iterations: iterations (rollout + update).
        fpo: the ratio (:class:`~mmpo.robotics.config.FPOConfig`: mc_samples M (8), clip (0.05), output_mode
            ("u_but_supervise_as_eps"), discretize_t (true: times from the Euler grid i/K)).
        env, returns, loss, optim, critic, evaluation, seed, env_factory, max_consecutive_skips: as
            :class:`~mmpo.robotics.dppo.DPPOModule` (``optim.minibatch_size`` counts env steps); the evaluation's
            ``sampler`` and ``ddpm_std_floor`` are DPPO chain settings and stay unset.
    """

    config_groups = ("env", "returns", "loss", "optim", "critic", "evaluation", "fpo")
    flat_names: dict[str, tuple[str, str]] = {}
    kind = "fpo"

    def __init__(
        self,
        bc_checkpoint: str,
        num_iterations: int = 81,
        *,
        fpo: FPOConfig = FPOConfig(),
        env: EnvConfig = EnvConfig(),
        returns: ReturnsConfig = ReturnsConfig(),
        loss: PPOLossConfig = PPOLossConfig(),
        optim: OptimConfig = FPO_OPTIM,
        critic: CriticConfig = CriticConfig(),
        evaluation: EvalConfig = EvalConfig(),
        seed: int = 0,
        env_factory: EnvFactory | None = None,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
    ) -> None:
        self.fpo = as_config(fpo, FPOConfig())
        evaluation = as_config(evaluation, EvalConfig())
        check_no_chain_eval(evaluation, "FPO")
        chain = DenoisingChainConfig(ft_steps=1, clip_base=self.fpo.clip, clip_final=self.fpo.clip)
        super().__init__(bc_checkpoint, num_iterations, env=env, chain=chain, returns=returns, loss=loss,
                         optim=as_config(optim, FPO_OPTIM), critic=critic, evaluation=evaluation, seed=seed,
                         env_factory=env_factory, max_consecutive_skips=max_consecutive_skips)
        self.hparams.pop("chain", None)  # built from ``fpo``, not an init argument here

    def load_actor(self, bc_checkpoint: str, ft_steps: int) -> tuple[FlowPolicy, dict[str, Any]]:
        policy, metadata = load_flow_policy(bc_checkpoint, "FPO")
        if policy.ft_network is None:
            policy.enable_finetuning(None)
        elif policy.finetune_config != {"noise": None}:
            raise ValueError(f"{bc_checkpoint} was fine-tuned by ReinFlow (a noise network); start FPO from its flow "
                             "BC checkpoint")
        return policy, metadata

    # ------------------------------------------------------------------ rollout
    def draw_step_noise(self, batch: int) -> list[torch.Tensor]:
        """One chunk step's draws for ``batch`` envs: x_0 (N, Ta, Da), the M CFM noise draws (N, M, Ta, Da) and
        times (N, M) (from the Euler grid i/K with ``fpo.discretize_t``, else U[0, 1))."""
        policy, samples, generator = self.policy, self.fpo.mc_samples, self._sampling_generator()
        shape = (batch, policy.horizon, policy.action_dim)
        x0 = torch.randn(shape, generator=generator, device=self.device)
        eps = torch.randn((batch, samples, *shape[1:]), generator=generator, device=self.device)
        if self.fpo.discretize_t:
            index = torch.randint(0, policy.num_steps, (batch, samples), generator=generator, device=self.device)
            tau = euler_times(policy.num_steps).to(self.device)[index]
        else:
            tau = torch.rand((batch, samples), generator=generator, device=self.device)
        return [x0, eps, tau]

    def act(self, obs: torch.Tensor, noise: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Chunks (N, Ta, Da) by the Euler flow from x_0, the stored sample (N, 1 + 2M, Ta, Da) and -mean_j L_old (N, 1)."""
        x0, eps, tau = noise if noise is not None else self.draw_step_noise(obs.shape[0])
        actions = self.policy.sample(obs, deterministic=True, noise=[x0]).actions
        old = -self.policy.cfm_losses(obs, actions, eps, tau, self.fpo.output_mode).mean(dim=1)
        return actions, pack_fpo_sample(actions, eps, tau), old.unsqueeze(1)

    def rescore(self, obs: torch.Tensor, chains: torch.Tensor, ft_index: torch.Tensor) -> torch.Tensor:
        """-mean_j L_new (B,) of the stored chunks under the same draws (gradients into the velocity copy)."""
        actions, eps, tau = unpack_fpo_sample(chains)
        return -self.policy.cfm_losses(obs, actions, eps, tau, self.fpo.output_mode).mean(dim=1)

    def robotics_metadata(self) -> dict[str, Any]:
        return {**super().robotics_metadata(), "kind": self.kind, "flow_finetune": self.policy.finetune_config}
