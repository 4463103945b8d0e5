"""PPO with a learned critic for LMs and VLMs (verl's original algorithm; TRL's ``PPOTrainer``).

A value model (a copy of the policy, or another checkpoint, with a scalar head) predicts V(s_t) at every
completion token. Each step: the rollout's token rewards are the outcome reward on the last generated token,
minus ``critic.kl_coef`` x KL(pi || pi_ref) per token when set (classic RLHF PPO; verl's ``use_kl_in_reward``);
token-level GAE over the old critic's values gives advantages (whitened) and returns
(:func:`mmpo.core.token_gae`); the update trains the policy with the core clipped loss and the critic with the
clipped value loss (:func:`mmpo.core.clipped_value_loss`) in the same optimizer step of the shared update
engine: two optimizers (the critic's own learning rate), each parameter group clipped to ``max_grad_norm``.
For the first ``critic.warmup_steps`` training steps only the critic learns (verl's ``trainer.critic_warmup``).

Defaults and their sources (docs/ppo.md): gamma 1.0, lam 1.0 (verl ``algorithm.gamma`` / ``algorithm.lam``),
value clip 0.5 (verl ``critic.cliprange_value``), critic lr 1e-5 (verl ``critic.optim.lr``), KL in the reward
off with kl_kind k1 (verl ``algorithm.use_kl_in_reward: false``, ``kl_penalty: kl``), advantages whitened
(verl ``compute_gae_advantage_return``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

from mmpo.algos.config import require
from mmpo.algos.grpo import GRPOModule, loss_mask
from mmpo.core import LossParts, clipped_value_loss, rlhf_token_rewards, token_gae
from mmpo.training.config import AdvantageConfig, as_config
from mmpo.training.optim import make_optimizer, max_steps_or_none
from mmpo.training.step_state import StepState
from mmpo.training.update import UpdateEngine
from mmpo.vlm.logprobs import completion_hidden_states
from mmpo.vlm.rollout import Rollout


@dataclass(frozen=True)
class ValueModelConfig:
    """The critic of :class:`PPOModule`.

    Attributes:
        model_path: checkpoint the value model starts from (its backbone; the head starts at zero); None: a copy
            of the policy.
        lr: the critic's learning rate (its own AdamW; verl ``critic.optim.lr`` 1e-5).
        weight_decay: the critic's AdamW weight decay.
        clip_range: value clipping around the old values (verl ``critic.cliprange_value`` 0.5); None: plain MSE.
        vf_coef: coefficient of the value loss (the critic has its own optimizer, so this scales its step).
        warmup_steps: training steps at the start in which only the critic learns (verl ``trainer.critic_warmup``).
        gamma: discount of the token-level GAE (verl ``algorithm.gamma`` 1.0).
        lam: GAE lambda (verl ``algorithm.lam`` 1.0).
        kl_coef: KL(pi || pi_ref) penalty per token in the reward (classic RLHF PPO); 0: off (verl's default).
        kl_kind: KL estimator of that penalty (k1 = verl's ``kl``).
        whiten: whiten the advantages over the batch's generated tokens (verl always does).
    """

    model_path: str | None = None
    lr: float = 1e-5
    weight_decay: float = 0.0
    clip_range: float | None = 0.5
    vf_coef: float = 1.0
    warmup_steps: int = 0
    gamma: float = 1.0
    lam: float = 1.0
    kl_coef: float = 0.0
    kl_kind: str = "k1"
    whiten: bool = True

    def __post_init__(self) -> None:
        require(self.lr > 0, f"critic.lr must be > 0, got {self.lr}")
        require(self.clip_range is None or self.clip_range > 0, f"critic.clip_range must be > 0 or null, got {self.clip_range}")
        require(self.vf_coef > 0, f"critic.vf_coef must be > 0, got {self.vf_coef}")
        require(self.warmup_steps >= 0, f"critic.warmup_steps must be >= 0, got {self.warmup_steps}")
        require(0 < self.gamma <= 1, f"critic.gamma must be in (0, 1], got {self.gamma}")
        require(0 <= self.lam <= 1, f"critic.lam must be in [0, 1], got {self.lam}")
        require(self.kl_coef >= 0, f"critic.kl_coef must be >= 0, got {self.kl_coef}")


class ValueModel(torch.nn.Module):
    """A causal LM / VLM backbone with a scalar head: V(s_t) at the position that predicts completion token t.

    The backbone's language-model head is kept (the same class loads and saves) but frozen: it is never used."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm
        for parameter in lm.get_output_embeddings().parameters():
            parameter.requires_grad_(False)
        hidden = lm.get_output_embeddings().weight.shape[1]
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.head.weight)  # V = 0 everywhere at the start: GAE begins as plain returns
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, rollout: Rollout) -> Tensor:
        """``(N, T)`` values (float32) over the completion positions of ``rollout``."""
        hidden = completion_hidden_states(self.lm, rollout.prompt_inputs, rollout.completion_ids,
                                          rollout.completion_mask)
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()


class PPOModule(GRPOModule):
    """PPO with a learned critic (module docstring). ``sampling.num_generations`` may be 1 (no groups needed);
    every other :class:`GRPOModule` setting applies (the policy loss, its clip bounds, ``loss.beta`` for a KL
    loss term, micro-batching, mu epochs)."""

    min_generations = 1  # GAE needs no group

    def __init__(self, model_path: str, *, critic: ValueModelConfig = ValueModelConfig(),
                 advantage: AdvantageConfig = AdvantageConfig(name="grpo"), **kwargs: Any) -> None:
        super().__init__(model_path, advantage=advantage, **kwargs)
        self.critic_config = as_config(critic, ValueModelConfig())
        if self.critic_config.model_path is None:
            backbone = copy.deepcopy(self.model)
        else:
            from mmpo.vlm.factory import load_vlm

            backbone = load_vlm(self.critic_config.model_path, dtype=self.hparams.dtype)[0]
        self.critic = ValueModel(backbone)
        if self.critic_config.kl_coef > 0 and self._reference[0] is None:
            from mmpo.training.lora import is_lora
            from mmpo.vlm.factory import make_reference_model

            if not is_lora(self.model):  # with LoRA the adapter-disabled policy is the reference already
                self._reference = [make_reference_model(self.model, self.critic_config.kl_coef)]
        self._frozen_policy: list[torch.nn.Parameter] = []  # the policy weights a critic warm-up froze
        # training steps done (a buffer: checkpointed, so a resumed run knows whether the warm-up is over)
        self.register_buffer("_ppo_steps", torch.zeros((), dtype=torch.long))
        self.update_engine = UpdateEngine(
            self, max_grad_norm=self.optim.max_grad_norm,
            clip_groups=lambda: [[p for p in self.model.parameters() if p.requires_grad],
                                 [p for p in self.critic.parameters() if p.requires_grad]],
        )

    # ------------------------------------------------------------------ optimizers

    def configure_optimizers(self) -> tuple[list, list]:
        """The policy's AdamW (as every VLM module's) and the critic's own, each with its schedule."""
        optim, critic = self.optim, self.critic_config
        total = max_steps_or_none(self)
        # the optimizer holds every trainable policy weight, also those a warm-up has frozen for now (a second fit)
        warming = bool(self._frozen_policy)
        self._freeze_policy(False)
        policy = make_optimizer(self.model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay,
                                betas=optim.betas, fused=True, warmup_steps=optim.warmup_steps, total_steps=total,
                                schedule=optim.lr_schedule)
        value = make_optimizer(self.critic.parameters(), lr=critic.lr, weight_decay=critic.weight_decay,
                               betas=optim.betas, fused=True, warmup_steps=optim.warmup_steps, total_steps=total,
                               schedule=optim.lr_schedule)
        self._freeze_policy(warming)
        return [policy["optimizer"], value["optimizer"]], [policy["lr_scheduler"], value["lr_scheduler"]]

    def _freeze_policy(self, frozen: bool) -> None:
        """Take the policy's trainable weights out of the gradient (the warm-up) or give them back (only those
        that were trainable: a LoRA policy's base weights stay frozen)."""
        if frozen and not self._frozen_policy:
            self._frozen_policy = [p for p in self.model.parameters() if p.requires_grad]
            for parameter in self._frozen_policy:
                parameter.requires_grad_(False)
        elif not frozen and self._frozen_policy:
            for parameter in self._frozen_policy:
                parameter.requires_grad_(True)
            self._frozen_policy = []

    # ------------------------------------------------------------------ step hooks

    def begin_step(self, state: StepState) -> None:
        """During the critic warm-up the policy's weights take no gradient (the value loss still trains the
        critic in the same engine step; the policy's optimizer then has nothing to apply)."""
        super().begin_step(state)
        warming = self._training_steps_done < self.critic_config.warmup_steps
        self._freeze_policy(warming)
        state.metrics["critic/warmup"] = float(warming)

    def end_step(self, state: StepState) -> None:
        super().end_step(state)
        self._training_steps_done += 1

    @property
    def _training_steps_done(self) -> int:
        return int(self._ppo_steps.item())

    @_training_steps_done.setter
    def _training_steps_done(self, value: int) -> None:
        self._ppo_steps.fill_(value)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.critic.train()

    # ------------------------------------------------------------------ advantages and the value loss

    def _old_values(self, rollout: Rollout) -> Tensor:
        micro = self.optim.micro_batch_size or len(rollout)
        values = []
        with torch.no_grad():
            for index in torch.arange(len(rollout)).split(micro):
                values.append(self.critic(rollout.select(index).to(self.device)).cpu())
        return torch.cat(values)

    def compute_advantages(self, rewards: Tensor, group_ids: Tensor, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        """Token-level GAE over the old critic's values; keeps the old values and returns in ``rollout.extras``
        for the value loss."""
        config = self.critic_config
        mask = loss_mask(rollout).to(rewards)
        values = self._old_values(rollout).to(rewards) * mask
        log_probs = ref_log_probs = None
        if config.kl_coef > 0:
            micro = self.optim.micro_batch_size or len(rollout)
            log_probs = self._log_probs_no_grad(self.model, rollout, micro).to(rewards)
            with self.reference_policy() as reference:
                ref_log_probs = self._log_probs_no_grad(reference, rollout, micro).to(rewards)
        token_rewards = rlhf_token_rewards(rewards, mask, log_probs=log_probs, ref_log_probs=ref_log_probs,
                                           kl_coef=config.kl_coef, kl_kind=config.kl_kind)
        advantages, returns = token_gae(token_rewards, values, mask, gamma=config.gamma, lam=config.lam,
                                        whiten=config.whiten)
        rollout.extras["ppo_old_values"] = values
        rollout.extras["ppo_returns"] = returns * mask
        tokens = mask.sum().clamp_min(1)
        metrics = {"critic/values_mean": float((values * mask).sum() / tokens),
                   "critic/returns_mean": float((returns * mask).sum() / tokens),
                   "critic/token_reward_mean": float((token_rewards * mask).sum() / tokens)}
        if config.kl_coef > 0:
            metrics["critic/kl_in_reward"] = float(((token_rewards - rlhf_token_rewards(rewards, mask)) * mask).sum()
                                                   / tokens / -config.kl_coef)
        return advantages, metrics

    def extra_loss_terms(self, minibatch: Rollout, outputs: Mapping[str, Any]) -> tuple[LossParts, dict[str, Any]]:
        """The critic's clipped value loss on this micro-batch, normalised like the policy loss."""
        predicted = self.critic(minibatch)
        loss, clipfrac = clipped_value_loss(
            predicted, minibatch.extras["ppo_old_values"].to(predicted), minibatch.extras["ppo_returns"].to(predicted),
            outputs["mask"], clip_range=self.critic_config.clip_range, agg=outputs["aggregation"])
        return LossParts().add("value", loss, self.critic_config.vf_coef), {"critic/vf_clipfrac": float(clipfrac)}
