"""DVPO: Decoupled Value Policy Optimization (arXiv 2502.16944; official code microsoft/DKI_LLM, folder ``dvpo/``).

Two stages, each a Lightning module:

1. :class:`GlobalValueModule` pretrains a global value model (GVM) offline on preference pairs
   (``dvpo/value_model_training/value_model_from_preference.py``, ``vas_trainer.py``): each pair gives two samples,
   prompt + chosen with terminal reward +1 and prompt + rejected with -1 (or scored completions: a ``score``
   column); the value at every response token regresses toward the GAE(gamma, lam) return computed with the
   pre-update values, loss ``0.5 x masked-mean((V - G)^2)`` with no value clipping, ``value_epochs`` optimizer
   steps per batch (the official ``vas_epochs``). The export is the backbone in HF format plus ``value_head.pt``.
2. :class:`DVPOModule` is :class:`~mmpo.algos.ppo.PPOModule` with that value model frozen as the critic
   (``dvpo/policy_model_training/policyv1_trainer.py``): no reward model and no critic updates; the token reward is
   the KL term alone, ``r_t = -kl_coef x (log pi_old - log pi_ref)`` (no sequence score); the frozen values are
   whitened before GAE (the official ``whiten(values)``), GAE(gamma 1, lam 0.95) with V = 0 past the last token,
   advantages whitened over the response tokens, the PPO clipped policy loss alone.

Deviations, each documented in docs/ppo.md: the official value whitening runs over the whole
[batch x sequence] tensor, prompt and padding positions included (it depends on the padding width); here it runs
over the real response tokens. The official KL coefficient is adaptive (init 0.2, target 6, horizon 10000);
here it is fixed (``kl_coef``, default 0.2). The reward functions are still evaluated, for logging only
(``rewards/*``): they do not enter the loss.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from mmpo.algos.config import require
from mmpo.algos.ppo import VALUE_HEAD_FILE, PPOModule
from mmpo.algos.vlm_base import VLMPolicyModule
from mmpo.core import masked_whiten, outcome_token_rewards, token_gae, value_loss
from mmpo.training.config import OptimConfig, ValueModelConfig, as_config
from mmpo.training.optim import make_optimizer, max_steps_or_none
from mmpo.training.update import MicroLoss, UpdateEngine
from mmpo.vlm.logprobs import completion_hidden_states
from mmpo.vlm.processing import encode_completions, encode_prompts, select_rows


class GlobalValueModule(VLMPolicyModule):
    """Stage 1 of DVPO: pretrain a global value model on preference pairs (or scored completions).

    ``self.model`` is the value model's backbone (loaded from ``model_path``: an SFT policy, as the official code
    starts from the policy's base), ``self.value_head`` its scalar head (zero-initialised as trl's
    ``AutoModelForCausalLMWithValueHead`` in the official code's use). The export (``output_dir``) is loadable as
    ``critic.path`` of :class:`DVPOModule` or :class:`~mmpo.algos.ppo.PPOModule`.

    Args:
        model_path: saved HF model directory of the backbone.
        chosen_reward: terminal reward of a chosen completion (official: +1).
        rejected_reward: terminal reward of a rejected completion (official: -1).
        gamma: GAE discount (official ``gamma``: 1.0).
        lam: GAE lambda (official ``lam``: 0.95).
        value_epochs: optimizer steps per batch on the same targets (official ``vas_epochs``: 2).
        max_completion_length: truncate completions to this many tokens (None = no limit).
        optim: AdamW and its schedule (the official run uses Adafactor, lr 1.41e-5, linear decay).
        save_hf_on_checkpoint: also write the value model to output_dir whenever a Lightning checkpoint is saved.
        **kwargs: the settings every VLM module shares (LoRA: ``lora_rank``; the official run uses r 8, alpha 32).
    """

    def __init__(
        self,
        model_path: str,
        *,
        chosen_reward: float = 1.0,
        rejected_reward: float = -1.0,
        gamma: float = 1.0,
        lam: float = 0.95,
        value_epochs: int = 2,
        max_completion_length: int | None = None,
        optim: OptimConfig = OptimConfig(lr=1.41e-5, lr_schedule="linear"),
        save_hf_on_checkpoint: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(model_path, optim=optim, save_hf_on_checkpoint=save_hf_on_checkpoint, **kwargs)
        self.automatic_optimization = False
        hidden = self.model.get_output_embeddings().weight.shape[1]
        self.value_head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        self.update_engine = UpdateEngine(
            self, max_grad_norm=self.optim.max_grad_norm,
            clip_groups=lambda: [[p for p in self.parameters() if p.requires_grad]])
        self.last_metrics: dict[str, float] = {}

    def _validate_settings(self) -> None:
        h = self.hparams
        require(0 < h.gamma <= 1, f"gamma must be in (0, 1], got {h.gamma}")
        require(0 <= h.lam <= 1, f"lam must be in [0, 1], got {h.lam}")
        require(h.value_epochs >= 1, f"value_epochs must be >= 1, got {h.value_epochs}")
        require(h.chosen_reward > h.rejected_reward,
                f"chosen_reward must exceed rejected_reward, got {h.chosen_reward} <= {h.rejected_reward}")

    def configure_optimizers(self) -> dict[str, Any]:
        return make_optimizer(self.parameters(), lr=self.optim.lr, weight_decay=self.optim.weight_decay,
                              betas=self.optim.betas, fused=True, warmup_steps=self.optim.warmup_steps,
                              schedule=self.optim.lr_schedule, total_steps=max_steps_or_none(self))

    # ------------------------------------------------------------------ samples and values

    def samples(self, rows: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], Tensor, Tensor, Tensor]:
        """(prompt inputs, completion ids, completion mask, terminal rewards) of a batch: every preference row
        gives prompt + chosen (``chosen_reward``) and prompt + rejected (``rejected_reward``); a row with a
        ``completion`` and a numeric ``score`` gives that one sample (the official ``value_model_from_rm``)."""
        h = self.hparams
        texts: list[str] = []
        prompt_index: list[int] = []
        rewards: list[float] = []
        for i, row in enumerate(rows):
            if isinstance(row.get("chosen"), str) and isinstance(row.get("rejected"), str):
                texts += [row["chosen"], row["rejected"]]
                prompt_index += [i, i]
                rewards += [h.chosen_reward, h.rejected_reward]
            elif isinstance(row.get("completion"), str) and isinstance(row.get("score"), (int, float)):
                texts.append(row["completion"])
                prompt_index.append(i)
                rewards.append(float(row["score"]))
            else:
                raise ValueError(f"row {row.get('id')!r} has neither 'chosen'/'rejected' nor 'completion'/'score': "
                                 "the value model trains on preference pairs (mmpo.data.datamodule.PreferenceDataModule)")
        prompts = encode_prompts(self.processor, rows, system_prompt=self.system_prompt,
                                 max_prompt_length=h.max_prompt_length)
        ids, mask = encode_completions(self.processor, texts, max_length=h.max_completion_length)
        inputs = select_rows(prompts, torch.tensor(prompt_index))
        inputs = {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in inputs.items()}
        return inputs, ids.to(self.device), mask.to(self.device), torch.tensor(rewards, device=self.device)

    def values(self, inputs: Mapping[str, Any], ids: Tensor, mask: Tensor) -> Tensor:
        """``(N, T)`` V(s_t) for every completion token (float32)."""
        hidden = completion_hidden_states(self.model, inputs, ids, mask)
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()

    def value_targets(self, rewards: Tensor, old_values: Tensor, mask: Tensor) -> Tensor:
        """GAE returns ``G = A + V_old`` of the terminal rewards (the official ``compute_advantages``), 0 off the
        mask."""
        mask_f = mask.to(old_values.dtype)
        token_rewards, _ = outcome_token_rewards(rewards.to(old_values.dtype), mask)
        _, returns = token_gae(token_rewards, old_values * mask_f, mask_f, gamma=self.hparams.gamma,
                               lam=self.hparams.lam)
        return returns * mask_f

    # ------------------------------------------------------------------ the step

    def training_step(self, batch: Sequence[Mapping[str, Any]], batch_idx: int) -> None:
        t0 = time.perf_counter()
        inputs, ids, mask, rewards = self.samples(list(batch))
        mask_f = mask.float()
        with torch.no_grad():
            old_values = self.values(inputs, ids, mask)
        returns = self.value_targets(rewards, old_values, mask)
        history = []
        for _ in range(self.hparams.value_epochs):
            def micro_loss(_: None) -> MicroLoss:
                values = self.values(inputs, ids, mask)
                loss, metrics = value_loss(values, returns, old_values, mask_f, clip=None)
                return MicroLoss(loss, {"losses/value": float(loss.detach()), **metrics})

            history.append(self.update_engine.optimizer_step([None], micro_loss).metrics)
        last = (torch.arange(mask.shape[1], device=mask.device) * mask).argmax(-1)
        final = old_values.gather(1, last[:, None]).squeeze(1)
        chosen = rewards == self.hparams.chosen_reward
        rejected = rewards == self.hparams.rejected_reward
        metrics = {k: sum(h[k] for h in history) / len(history) for k in history[0]}
        metrics["value/final_chosen_mean"] = float(final[chosen].mean()) if bool(chosen.any()) else 0.0
        metrics["value/final_rejected_mean"] = float(final[rejected].mean()) if bool(rejected.any()) else 0.0
        metrics["perf/step_s"] = time.perf_counter() - t0
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(batch))
        self.last_metrics = metrics

    def save_hf(self, output_dir: str | Path | None = None) -> Path | None:
        """The backbone in HF format and ``value_head.pt`` beside it (a value model for ``critic.path``)."""
        from mmpo.files import atomic_outputs

        written = super().save_hf(output_dir)
        if written is not None:
            with atomic_outputs(Path(written) / VALUE_HEAD_FILE) as (temp,):
                torch.save(self.value_head.state_dict(), temp)
        return written


class DVPOModule(PPOModule):
    """Stage 2 of DVPO: PPO against a frozen pretrained global value model; see the module docstring.

    Args:
        model_path: saved HF model directory of the policy.
        critic: the value model (``path``: a :class:`GlobalValueModule` export; it is always frozen).
        kl_coef: the KL coefficient of the token rewards (official ``init_kl_coef``: 0.2, fixed here).
        gamma: GAE discount (official 1.0).
        lam: GAE lambda (official 0.95).
        **kwargs: every :class:`~mmpo.algos.ppo.PPOModule` setting.
    """

    def __init__(
        self,
        model_path: str,
        *,
        critic: ValueModelConfig = ValueModelConfig(frozen=True),
        kl_coef: float = 0.2,
        gamma: float = 1.0,
        lam: float = 0.95,
        **kwargs: Any,
    ) -> None:
        critic = dataclasses.replace(as_config(critic, ValueModelConfig(frozen=True)), frozen=True)
        require(critic.path is not None and (Path(critic.path) / VALUE_HEAD_FILE).is_file(),
                f"DVPO needs a pretrained value model: critic.path must be a GlobalValueModule export with "
                f"{VALUE_HEAD_FILE}, got {critic.path!r}")
        super().__init__(model_path, critic=critic, kl_coef=kl_coef, gamma=gamma, lam=lam, **kwargs)

    def token_rewards(self, rewards: Tensor, rollout: Any) -> tuple[Tensor, dict[str, float]]:
        """The KL term alone: the outcome score is 0 (the reward functions are only logged)."""
        return super().token_rewards(torch.zeros_like(rewards), rollout)

    def prepare_values(self, values: Tensor, mask: Tensor) -> Tensor:
        """The frozen values whitened (official ``whiten(values)``; here over the real response tokens)."""
        return masked_whiten(values, mask) if int(mask.sum()) > 1 else values
