"""ReinFlow: PPO fine-tuning of a flow-matching policy through its noise-injected Euler chain (arXiv 2505.22094).

A learned noise network sigma(s) in [min_std, max_std] makes each of the K Euler steps of the BC flow policy a
Gaussian transition x_{i+1} ~ N(clamp(x_i + v(x_i, i/K)/K), sigma(s)^2), so the chain x_0 .. x_K that produced an
action chunk has an exact log-likelihood (normalised per step and entry, clamped to [-1, 1]; ReinFlow/ReinFlow
``model/flow/ft_ppo/ppoflow.py``, ``get_logprobs`` / ``get_actions``). PPO treats the whole chain as one action:
one clipped ratio per env step (clip 0.01), plus an entropy-rate bonus (0.01) on the noise.

:class:`ReinFlowModule` is a :class:`~mmpo.robotics.dppo.DPPOModule` whose "chain" is that one Gaussian chain per
env step (K' = 1 in the DPPO update's view): the same vector envs, rollout, running reward scaling, critic, GAE
(:func:`mmpo.core.gae`), minibatch loop through the shared update engine, core PPO loss
(:func:`mmpo.core.policy_loss`), target-KL stop, checkpoints and bit-exact resume. docs/flow_policies.md lists
every default with its source.
"""

from __future__ import annotations

from typing import Any

import torch

from mmpo.robotics.config import DenoisingChainConfig, EnvConfig, EvalConfig, PPOLossConfig, ReinFlowConfig, ReturnsConfig
from mmpo.robotics.config import refuse_chain_evaluation
from mmpo.robotics.dppo import DPPOModule, EnvFactory
from mmpo.robotics.policy.flow import FlowPolicy
from mmpo.robotics.policy.io import load_policy
from mmpo.training.config import CriticConfig, OptimConfig, as_config
from mmpo.training.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS

REINFLOW_OPTIM = OptimConfig(lr=2e-5, weight_decay=0.0, max_grad_norm=0.0, mu=10, minibatch_size=500)
"""ReinFlow's robomimic actor update (``ft_ppo_reflow_mlp_img.yaml``): lr 2e-5 (constant here; the official cosine
schedule decays to 1e-5), no weight decay, no gradient clipping, 10 epochs of minibatches of 500 env steps."""
REINFLOW_CRITIC = CriticConfig(lr=6.5e-4, vf_coef=0.5, warmup_iterations=2)
"""ReinFlow's critic: lr 6.5e-4, vf_coef 0.5, 2 warm-up iterations (``n_critic_warmup_itr``)."""
REINFLOW_LOSS = PPOLossConfig(name="ppo", target_kl=0.01)
"""The clipped PPO loss; ``target_kl`` 0.01 stops an iteration's update (``lr_schedule: fixed``)."""


def load_flow_policy(path: str, method: str) -> tuple[FlowPolicy, dict[str, Any]]:
    """The flow policy of ``path`` (a flow BC, ReinFlow or FPO checkpoint); a clear error for any other policy."""
    policy, metadata = load_policy(path)
    if not isinstance(policy, FlowPolicy):
        raise ValueError(f"{path} holds a {metadata.get('kind')!r} policy, not a flow-matching one; {method} fine-tunes "
                         "a flow-matching policy (pre-train one with configs/robotics/flow_bc_lift.yaml)")
    return policy, metadata


def check_no_chain_eval(evaluation: EvalConfig, method: str) -> None:
    refuse_chain_evaluation(evaluation, f"are DPPO's diffusion-chain settings; {method}'s flow policy has none")


class ReinFlowModule(DPPOModule):
    """ReinFlow fine-tuning of a flow BC checkpoint (:class:`~mmpo.robotics.flow_bc.FlowBCModule`).

    Args:
        bc_checkpoint: a flow BC (or ReinFlow) ``.ckpt`` / ``policy.safetensors``; its EMA policy's velocity network
            is copied and trained together with a new noise network; the BC network stays frozen.
        num_iterations: iterations (rollout + update).
        reinflow: the noise network and the ratio (:class:`~mmpo.robotics.config.ReinFlowConfig`: min_std, max_std
            (0.08, 0.14), noise_hidden_dims ([256, 256, 256]), noise_activation (tanh), clip (0.01), ent_coef (0.01),
            logprob_min / logprob_max (-1, 1), noise_clip (3), include_initial (true)).
        env, returns, loss, optim, critic, evaluation, seed, env_factory, max_consecutive_skips: as
            :class:`~mmpo.robotics.dppo.DPPOModule`; ``optim.minibatch_size`` counts env steps (500), ``loss.target_kl``
            0.01, critic lr 6.5e-4; the evaluation's ``sampler`` and ``ddpm_std_floor`` are DPPO chain settings and
            stay unset (evaluation runs the noise-free flow).
    """

    config_groups = ("env", "returns", "loss", "optim", "critic", "evaluation", "reinflow")
    flat_names: dict[str, tuple[str, str]] = {}
    kind = "reinflow"

    def __init__(
        self,
        bc_checkpoint: str,
        num_iterations: int = 81,
        *,
        reinflow: ReinFlowConfig = ReinFlowConfig(),
        env: EnvConfig = EnvConfig(),
        returns: ReturnsConfig = ReturnsConfig(),
        loss: PPOLossConfig = REINFLOW_LOSS,
        optim: OptimConfig = REINFLOW_OPTIM,
        critic: CriticConfig = REINFLOW_CRITIC,
        evaluation: EvalConfig = EvalConfig(),
        seed: int = 0,
        env_factory: EnvFactory | None = None,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
    ) -> None:
        self.reinflow = as_config(reinflow, ReinFlowConfig())
        evaluation = as_config(evaluation, EvalConfig())
        check_no_chain_eval(evaluation, "ReinFlow")
        settings = self.reinflow
        chain = DenoisingChainConfig(ft_steps=1, clip_base=settings.clip, clip_final=settings.clip,
                                     noise_clip=settings.noise_clip, logprob_min=settings.logprob_min,
                                     logprob_max=settings.logprob_max)
        super().__init__(bc_checkpoint, num_iterations, env=env, chain=chain, returns=returns,
                         loss=as_config(loss, REINFLOW_LOSS), optim=as_config(optim, REINFLOW_OPTIM),
                         critic=as_config(critic, REINFLOW_CRITIC), evaluation=evaluation, seed=seed,
                         env_factory=env_factory, max_consecutive_skips=max_consecutive_skips)
        self.hparams.pop("chain", None)  # built from ``reinflow``, not an init argument here

    def noise_settings(self) -> dict[str, Any]:
        settings = self.reinflow
        return {"hidden_dims": list(settings.noise_hidden_dims), "min_std": settings.min_std,
                "max_std": settings.max_std, "activation": settings.noise_activation,
                "time_conditioned": settings.noise_time_conditioned}

    def load_actor(self, bc_checkpoint: str, ft_steps: int) -> tuple[FlowPolicy, dict[str, Any]]:
        policy, metadata = load_flow_policy(bc_checkpoint, "ReinFlow")
        if policy.ft_network is None:
            policy.enable_finetuning(self.noise_settings())
        elif policy.finetune_config != {"noise": self.noise_settings()}:
            raise ValueError(f"{bc_checkpoint} was fine-tuned with {policy.finetune_config}, not this config's "
                             f"noise network {self.noise_settings()}; start from its flow BC checkpoint")
        return policy, metadata

    # ------------------------------------------------------------------ the chain as one PPO action
    def act(self, obs: torch.Tensor, noise: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Action chunks (N, Ta, Da), the chains x_0 .. x_K (N, K+1, Ta, Da) and their clamped normalised log-probs
        (N, 1). ``noise``: :meth:`draw_step_noise`'s rows (x_0 and the K step draws)."""
        settings = self.reinflow
        sample = self.policy.sample(obs, generator=self._sampling_generator(), noise=noise, noise_clip=settings.noise_clip,
                                    return_log_probs=True, include_initial=settings.include_initial)
        logp = sample.log_probs.clamp(settings.logprob_min, settings.logprob_max)
        return sample.actions, sample.chain, logp.unsqueeze(1)

    def rescore(self, obs: torch.Tensor, chains: torch.Tensor, ft_index: torch.Tensor) -> torch.Tensor:
        """The stored chains' clamped log-probs (B,) under the current velocity copy and noise network."""
        settings = self.reinflow
        logp = self.policy.chain_log_prob(obs, chains, include_initial=settings.include_initial)
        return logp.clamp(settings.logprob_min, settings.logprob_max)

    def minibatch_loss(self, obs: torch.Tensor, chains: torch.Tensor, ft_index: torch.Tensor, old_log_probs: torch.Tensor,
                       advantages: torch.Tensor, returns: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """DPPO's minibatch loss (core PPO clip on the chain ratio, critic MSE) with the old log-probs clamped as the
        new ones (ReinFlow clamps both; a rollout's are clamped already), minus ent_coef x the chain's entropy rate
        (ReinFlow: ``loss = pg_loss - ent_coef * entropy.mean() + vf_coef * v_loss``)."""
        settings = self.reinflow
        old_log_probs = old_log_probs.clamp(settings.logprob_min, settings.logprob_max)
        pg_loss, value_loss, ratio, metrics = super().minibatch_loss(obs, chains, ft_index, old_log_probs, advantages,
                                                                     returns)
        if settings.ent_coef:
            entropy = self.policy.chain_entropy(obs, include_initial=settings.include_initial).mean()
            pg_loss = pg_loss - settings.ent_coef * entropy
        return pg_loss, value_loss, ratio, metrics

    def ppo_update(self, rollout: Any, train_actor: bool) -> dict[str, float]:
        """DPPO's update, plus the noise network's mean std on the rollout's observations after it (``policy/noise_std``)."""
        metrics = super().ppo_update(rollout, train_actor)
        with torch.no_grad():
            obs = rollout.obs.reshape(-1, rollout.obs.shape[-1]).to(self.device)
            metrics["policy/noise_std"] = float(self.policy.step_stds(obs).mean())
        return metrics

    def robotics_metadata(self) -> dict[str, Any]:
        return {**super().robotics_metadata(), "kind": self.kind, "flow_finetune": self.policy.finetune_config}
