"""DVPO (arXiv 2502.16944; official code microsoft/DKI_LLM, ``dvpo/``): PPO against a pretrained, frozen global value
model, with no reward model and no critic updates.

Two stages:

1. :class:`ValuePretrainModule` (``value_model_training/value_model_from_preference.py`` + ``vas_trainer.py``): a value
   model (the policy's backbone with a scalar head) learns from preference pairs: the chosen response's terminal
   reward is +1, the rejected one's -1, placed on the last response token; returns by GAE over the current values
   (gamma 1, lam 0.95: ``vas_config.py``); loss 0.5 x the masked mean of (V - R)^2, unclipped (``VASTrainer.loss``).
   The export writes the backbone (``save_pretrained``) and the head (``value_head.safetensors``).
2. :class:`DVPOModule` (``policy_model_training/policyv1_trainer.py``): the frozen value model's values, whitened over
   the batch (``whiten(values)``: every entry, as the official code), are the critic; token rewards are only the KL
   penalty -kl_coef x KL(pi || pi_ref) (``compute_rewards`` without a score); GAE (gamma 1, lam 0.95:
   ``policyv1_config.py``) with whitened advantages; the policy trains with the core clipped loss. The KL coefficient
   follows TRL's adaptive controller by default (``adap_kl_ctrl: true``, ``init_kl_coef`` 0.2, ``target`` 6,
   ``horizon`` 10000), its value checkpointed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from mmpo.algos.config import require
from mmpo.algos.grpo import loss_mask
from mmpo.algos.ppo import PPOModule, ValueModel, ValueModelConfig
from mmpo.algos.vlm_base import VLMPolicyModule
from mmpo.core import LossParts, clipped_value_loss, rlhf_token_rewards, token_gae
from mmpo.training.config import OptimConfig, as_config
from mmpo.training.optim import make_optimizer, max_steps_or_none
from mmpo.training.step_state import StepState
from mmpo.training.update import UpdateEngine
from mmpo.vlm.processing import encode_completions, encode_prompts, select_rows
from mmpo.vlm.rollout import Rollout


def adaptive_kl_coef(value: float, current_kl: float, target: float, horizon: int, n_steps: int) -> float:
    """TRL's ``AdaptiveKLController.update`` (Ziegler et al. 2019): the coefficient times
    1 + clip(KL / target - 1, -0.2, 0.2) x n_steps / horizon."""
    proportional_error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return value * (1.0 + proportional_error * n_steps / horizon)


class ValuePretrainModule(VLMPolicyModule):
    """DVPO's stage 1: a global value model from preference pairs (module docstring); the data is
    :class:`~mmpo.data.datamodule.PreferenceDataModule` (rows with ``chosen`` / ``rejected``).

    Args:
        model_path: the backbone's starting checkpoint (the policy's).
        gamma, lam: GAE of the returns (official ``vas_config.py``: 1.0, 0.95).
        max_completion_length: responses cut to this many tokens (None: whole).
        **kwargs: every VLM module setting (``optim``, ``output_dir``, ...).
    """

    def __init__(self, model_path: str, *, gamma: float = 1.0, lam: float = 0.95,
                 max_completion_length: int | None = None, optim: OptimConfig = OptimConfig(lr=1.41e-5),
                 save_hf_on_checkpoint: bool = False, **kwargs: Any) -> None:
        super().__init__(model_path, optim=optim, save_hf_on_checkpoint=save_hf_on_checkpoint, **kwargs)
        self.value_model = ValueModel(self.model)

    def _validate_settings(self) -> None:
        h = self.hparams
        require(0 < h.gamma <= 1, f"gamma must be in (0, 1], got {h.gamma}")
        require(0 <= h.lam <= 1, f"lam must be in [0, 1], got {h.lam}")

    def pairs(self, rows: Sequence[Mapping[str, Any]]) -> tuple[Rollout, Tensor]:
        """The chosen then the rejected responses of ``rows`` as one batch, and their terminal rewards (+1 / -1)."""
        for row in rows:
            if not isinstance(row.get("chosen"), str) or not isinstance(row.get("rejected"), str):
                raise ValueError(f"row {row.get('id')!r} has no 'chosen' / 'rejected' response: the value model "
                                 "learns from preference pairs (mmpo.data.datamodule.PreferenceDataModule)")
        prompts = encode_prompts(self.processor, rows, system_prompt=self.system_prompt,
                                 max_prompt_length=self.hparams.max_prompt_length)
        texts = [row["chosen"] for row in rows] + [row["rejected"] for row in rows]
        ids, mask = encode_completions(self.processor, texts, max_length=self.hparams.max_completion_length)
        both = select_rows(prompts, torch.arange(len(rows)).repeat(2))
        batch = Rollout(rows=list(rows) * 2, group_ids=torch.arange(2 * len(rows)), prompt_inputs=both,
                        completion_ids=ids, completion_mask=mask, texts=texts).to(self.device)
        outcome = torch.cat([torch.ones(len(rows)), -torch.ones(len(rows))]).to(self.device)
        return batch, outcome

    def value_loss(self, rows: Sequence[Mapping[str, Any]]) -> tuple[Tensor, dict[str, float]]:
        batch, outcome = self.pairs(rows)
        mask = batch.completion_mask.float()
        with torch.no_grad():
            old = self.value_model(batch) * mask
        _, returns = token_gae(rlhf_token_rewards(outcome, mask), old, mask, gamma=self.hparams.gamma,
                               lam=self.hparams.lam, whiten=False)
        predicted = self.value_model(batch)
        loss, _ = clipped_value_loss(predicted, old, returns * mask, mask, clip_range=None)
        tokens = mask.sum().clamp_min(1)
        chosen, rejected = predicted.detach().chunk(2)
        last = (mask.sum(-1).long() - 1).clamp_min(0)
        final = predicted.detach().gather(1, last.unsqueeze(1)).squeeze(1)
        return loss, {"losses/value": float(loss.detach()),
                      "value/chosen_mean": float((chosen * mask[: len(rows)]).sum() / mask[: len(rows)].sum().clamp_min(1)),
                      "value/rejected_mean": float((rejected * mask[len(rows):]).sum() / mask[len(rows):].sum().clamp_min(1)),
                      "value/final_accuracy": float(((final[: len(rows)] > 0).float().mean()
                                                     + (final[len(rows):] < 0).float().mean()) / 2),
                      "value/returns_mean": float((returns * mask).sum() / tokens)}

    def training_step(self, batch: Sequence[Mapping[str, Any]], batch_idx: int) -> Tensor:
        loss, metrics = self.value_loss(list(batch))
        self.log_dict(metrics, on_step=True, batch_size=len(batch), prog_bar=True)
        return loss

    def validation_step(self, batch: Sequence[Mapping[str, Any]], batch_idx: int) -> None:
        _, metrics = self.value_loss(list(batch))
        self.log_dict({f"val/{k.split('/', 1)[1]}": v for k, v in metrics.items()}, batch_size=len(batch))

    def configure_optimizers(self) -> dict[str, Any]:
        optim = self.optim
        return make_optimizer(self.value_model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay,
                              betas=optim.betas, fused=True, warmup_steps=optim.warmup_steps,
                              total_steps=max_steps_or_none(self), schedule=optim.lr_schedule)

    def save_hf(self, output_dir: str | Path | None = None) -> Path | None:
        """The backbone (``save_pretrained``) and, beside it, the head: what ``critic.model_path`` of
        :class:`DVPOModule` reads (:meth:`ValueModel.from_pretrained`)."""
        path = super().save_hf(output_dir)
        if path is not None:
            self.value_model.save_head(path)
        return path


@dataclass(frozen=True)
class KLControlConfig:
    """DVPO's KL penalty in the reward (TRL's PPOConfig fields, the official ``policyv1_config.py`` defaults).

    Attributes:
        init_kl_coef: the starting coefficient (0.2).
        adaptive: TRL's adaptive controller (``adap_kl_ctrl: true``); False keeps ``init_kl_coef``.
        target: the KL the adaptive controller steers to (6.0).
        horizon: its horizon in samples (10000).
        kind: the per-token KL estimator (``kl`` = k1).
    """

    init_kl_coef: float = 0.2
    adaptive: bool = True
    target: float = 6.0
    horizon: int = 10000
    kind: str = "k1"

    def __post_init__(self) -> None:
        require(self.init_kl_coef >= 0, f"kl.init_kl_coef must be >= 0, got {self.init_kl_coef}")
        require(self.target > 0 and self.horizon > 0, "kl.target and kl.horizon must be > 0")


class DVPOModule(PPOModule):
    """DVPO's stage 2 (module docstring): ``critic.model_path`` is the pretrained value model (required); its
    weights never change; the rollout's rewards are logged but do not train the policy."""

    def __init__(self, model_path: str, *, critic: ValueModelConfig = ValueModelConfig(lam=0.95),
                 kl: KLControlConfig = KLControlConfig(), **kwargs: Any) -> None:
        critic = as_config(critic, ValueModelConfig(lam=0.95))
        require(critic.model_path is not None, "DVPO needs critic.model_path: the value model of its first stage "
                                               "(mmpo.algos.dvpo.ValuePretrainModule's output_dir)")
        super().__init__(model_path, critic=critic, **kwargs)
        self.kl_control = as_config(kl, KLControlConfig())
        self.hparams["kl"] = dataclasses.asdict(self.kl_control)  # plain dicts in checkpoints (as every group)
        if self._reference[0] is None:
            from mmpo.training.lora import is_lora
            from mmpo.vlm.factory import make_reference_model

            if not is_lora(self.model):
                self._reference = [make_reference_model(self.model, 1.0)]
        for parameter in self.critic.parameters():  # a frozen global value model: no critic updates
            parameter.requires_grad_(False)
        self.register_buffer("kl_coef", torch.tensor(float(self.kl_control.init_kl_coef), dtype=torch.float64))
        self.update_engine = UpdateEngine(self, max_grad_norm=self.optim.max_grad_norm,
                                          clip_groups=lambda: [[p for p in self.model.parameters() if p.requires_grad]])

    def configure_optimizers(self) -> dict[str, Any]:
        optim = self.optim
        return make_optimizer(self.model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay,
                              betas=optim.betas, fused=True, warmup_steps=optim.warmup_steps,
                              total_steps=max_steps_or_none(self), schedule=optim.lr_schedule)

    def compute_advantages(self, rewards: Tensor, group_ids: Tensor, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        mask = loss_mask(rollout).to(rewards)
        values = self._old_values(rollout).to(rewards)
        values = ((values - values.mean()) * torch.rsqrt(values.var() + 1e-8)) * mask  # official: whiten(values)
        micro = self.optim.micro_batch_size or len(rollout)
        log_probs = self._log_probs_no_grad(self.model, rollout, micro).to(rewards)
        with self.reference_policy() as reference:
            ref_log_probs = self._log_probs_no_grad(reference, rollout, micro).to(rewards)
        coef = float(self.kl_coef)
        token_rewards = rlhf_token_rewards(torch.zeros_like(rewards), mask, log_probs=log_probs,
                                           ref_log_probs=ref_log_probs, kl_coef=coef, kl_kind=self.kl_control.kind)
        config = self.critic_config
        advantages, _ = token_gae(token_rewards, values, mask, gamma=config.gamma, lam=config.lam)
        kl = ((log_probs - ref_log_probs) * mask).sum(-1).mean()  # TRL's objective/kl: summed per sequence
        rollout.extras["dvpo_kl"] = float(kl)  # read by end_step from the step's state (state.rollout)
        return advantages, {"dvpo/kl_coef": coef, "dvpo/kl": float(kl),
                            "critic/values_mean": float(values.sum() / mask.sum().clamp_min(1))}

    def end_step(self, state: StepState) -> None:
        super().end_step(state)
        control = self.kl_control
        if control.adaptive and state.rollout is not None and "dvpo_kl" in state.rollout.extras:
            self.kl_coef.fill_(adaptive_kl_coef(float(self.kl_coef), state.rollout.extras["dvpo_kl"], control.target,
                                                control.horizon, len(state.rollout)))

    def extra_loss_terms(self, minibatch: Rollout, outputs: Mapping[str, Any]) -> tuple[LossParts, dict[str, Any]]:
        return LossParts(), {}  # the value model is frozen: no value loss
