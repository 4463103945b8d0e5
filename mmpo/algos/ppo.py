"""PPO with a learned critic for language and vision-language models (verl's original algorithm, TRL's PPOTrainer).

One step, through :class:`~mmpo.algos.grpo.GRPOModule`'s hooks and its update engine:

1. rollout and rewards as GRPO (any ``num_generations``, 1 included: the critic is the baseline);
2. ``compute_advantages``: the value model's per-token values V(s_t) (no grad), the outcome reward at each
   completion's last token minus ``kl_coef x KL(pi_old || pi_ref)`` on every token when the KL is in the reward
   (:func:`mmpo.core.outcome_token_rewards`), GAE over the tokens (:func:`mmpo.core.token_gae`, verl's
   ``compute_gae_advantage_return``), advantages whitened over the batch (``masked_whiten``, as verl and TRL);
   the returns and rollout-time values ride in ``rollout.extras`` to the update;
3. the update: the policy loss of ``loss`` (PPO clip by default) plus ``extra_loss_terms``' value loss
   ``vf_coef x 0.5 x token-mean(max((V - R)^2, (clip(V, V_old +- c) - R)^2))`` (:func:`mmpo.core.value_loss`,
   verl's ``compute_value_loss``). The two losses touch disjoint parameters; one backward, each group's
   gradient norm clipped on its own by the update engine, one AdamW with the critic as its own parameter group
   (its lr and weight decay), one schedule;
4. critic warm-up: during the first ``critic.warmup_steps`` optimizer steps the policy's parameters take no
   gradient (``begin_step``/``end_step``), so AdamW leaves them and their state untouched (verl's
   ``trainer.critic_warmup``).

The value model (:class:`TokenValueModel`) is a separate backbone loaded from ``critic.path`` (default: the
policy's ``model_path``) with a scalar head on its final hidden states; it is a submodule, so Lightning checkpoints
save and restore it with the optimizer state (exact resume). ``critic.frozen`` keeps it fixed (DVPO,
:mod:`mmpo.algos.dvpo`). docs/ppo.md.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from mmpo.algos.config import refuse_rollout_correction, require
from mmpo.algos.grpo import GRPOModule, loss_mask
from mmpo.core import LossParts, masked_whiten, outcome_token_rewards, token_gae, value_loss
from mmpo.training.config import AdvantageConfig, ValueModelConfig, as_config
from mmpo.training.lora import LoraSettings, is_lora, unwrap, wrap_with_lora
from mmpo.training.optim import make_optimizer, max_steps_or_none
from mmpo.training.step_state import StepState
from mmpo.training.update import UpdateEngine
from mmpo.vlm.factory import load_vlm, make_reference_model, save_vlm
from mmpo.vlm.fsdp import as_root_forward, full_state_dict, is_sharded, shard_vlm
from mmpo.vlm.logprobs import _decoder, completion_hidden_states, sequence_inputs
from mmpo.vlm.rollout import Rollout, completion_attention_mask

log = logging.getLogger(__name__)

VALUE_HEAD_FILE = "value_head.pt"


class TokenValueModel(torch.nn.Module):
    """V(s_t) for every completion token: a causal (V)LM backbone and a linear head on its final hidden state
    at the position that predicts token t (verl's critic: ``AutoModelForTokenClassification`` with one label).

    Args:
        backbone: the HF model (its ``.model`` gives the hidden states; its LM head is not used and is frozen
            unless tied to the input embeddings).
        head_init_std: normal std of the head's weight (bias 0); 0 = zeros.
        seed: seed of the head's initialisation (a forked RNG: the global streams are untouched).
    """

    def __init__(self, backbone: torch.nn.Module, *, head_init_std: float = 0.02, seed: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        output = unwrap(backbone).get_output_embeddings()
        hidden = output.weight.shape[1]
        if output.weight is not unwrap(backbone).get_input_embeddings().weight:
            output.weight.requires_grad_(False)  # the LM head plays no part in a value
        self.head = torch.nn.Linear(hidden, 1)
        with torch.no_grad():
            generator = torch.Generator().manual_seed(seed)
            self.head.weight.copy_(torch.randn(self.head.weight.shape, generator=generator) * head_init_std)
            self.head.bias.zero_()

    def forward(self, rollout: Rollout) -> Tensor:
        """``(N, T)`` values of ``rollout``'s completion tokens (float32)."""
        # sharded (FSDP2): run as a forward of the backbone's root unit, so its own weights are gathered
        hidden = as_root_forward(self.backbone, completion_hidden_states, self.backbone, rollout.prompt_inputs,
                                 rollout.completion_ids, completion_attention_mask(rollout))
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()

    def state_values(self, rollout: Rollout) -> Tensor:
        """``(N, T + 1)`` float32: V(s_t) before each completion token t (the columns of :meth:`forward`) and, at
        column ``l`` of a completion of length ``l``, the value after its last token (T-PPO bootstraps a
        truncated response with it)."""
        hidden = as_root_forward(self.backbone, states_from_last_prompt_token, self.backbone, rollout)
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()

    def shard(self, mesh: Any, *, frozen: bool) -> None:
        """FSDP2 over ``mesh``: the backbone as a policy (mmpo.vlm.fsdp.shard_vlm), the head as its own unit (so
        its gradient is reduced over the ranks too)."""
        from torch.distributed.fsdp import fully_shard

        shard_vlm(self.backbone, mesh, frozen=frozen)
        fully_shard(self.head, mesh=mesh)

    def full_state(self) -> tuple[dict[str, Tensor] | None, dict[str, Tensor]]:
        """(the backbone's full weights when sharded, else None; the head's full weights). Collective when sharded:
        every rank must call it."""
        if not is_sharded(self.backbone):
            return None, self.head.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        head = get_model_state_dict(self.head, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return full_state_dict(self.backbone), head

    def save(self, directory: str | Path, processor: Any, *, state: tuple[dict | None, dict] | None = None) -> Path:
        """The backbone and its processor in HF format plus ``value_head.pt`` (loadable as ``critic.path``);
        ``state``: :meth:`full_state`, gathered beforehand on every rank when sharded."""
        from mmpo.files import atomic_outputs

        directory = Path(directory)
        backbone_state, head_state = state if state is not None else self.full_state()
        # a LoRA backbone: merged weights plus its adapter
        save_vlm(self.backbone, processor, directory, state_dict=backbone_state)
        with atomic_outputs(directory / VALUE_HEAD_FILE) as (temp,):
            torch.save(head_state, temp)
        return directory

    @classmethod
    def load(cls, path: str | Path, *, dtype: torch.dtype = torch.float32, head_init_std: float = 0.02,
             seed: int = 0) -> "TokenValueModel":
        """A value model from a saved HF model; its head from ``path/value_head.pt`` when present."""
        backbone, _ = load_vlm(path, dtype=dtype)
        model = cls(backbone, head_init_std=head_init_std, seed=seed)
        head = Path(path) / VALUE_HEAD_FILE
        if head.is_file():
            model.head.load_state_dict(torch.load(head, map_location="cpu", weights_only=True))
        return model


def states_from_last_prompt_token(model: torch.nn.Module, rollout: Rollout) -> Tensor:
    """``(N, T + 1, H)`` final hidden states of ``model`` over ``[prompt | completion]`` from the prompt's last
    position on: column t is the state that predicts completion token t, column T the state after the last
    column's token."""
    inputs = sequence_inputs(rollout.prompt_inputs, rollout.completion_ids, rollout.completion_mask)
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(next(model.parameters()).dtype)
    hidden = _decoder(model)(**inputs, use_cache=False).last_hidden_state
    return hidden[:, rollout.prompt_inputs["input_ids"].shape[1] - 1:]


def shard_value_model(module: Any, value_model: TokenValueModel, *, frozen: bool) -> None:
    """Shard ``value_model`` over the module's data-parallel mesh when its trainer runs FSDP2 (and it is not yet)."""
    from mmpo.training.fsdp import FSDP2Strategy

    strategy = module._trainer.strategy if module._trainer is not None else None
    if isinstance(strategy, FSDP2Strategy) and not is_sharded(value_model.backbone):
        value_model.shard(module.device_mesh["data_parallel"], frozen=frozen)


class PPOModule(GRPOModule):
    """PPO with a value model for a (V)LM policy; see the module docstring.

    Args:
        model_path: saved HF model directory of the policy.
        critic: the value model (:class:`~mmpo.training.config.ValueModelConfig`: path, lr, weight_decay, vf_coef,
            cliprange_value, warmup_steps, frozen, head_init_std, lora_rank, lora_alpha).
        gamma: GAE discount over tokens (verl ``algorithm.gamma``: 1.0).
        lam: GAE lambda (verl ``algorithm.lam``: 1.0).
        kl_coef: coefficient of the KL to the reference inside the token rewards (verl
            ``algorithm.use_kl_in_reward`` with ``kl_ctrl.kl_coef``: off, 0.001 when on); 0 = off. The KL loss term
            is ``loss.beta`` as in GRPO (verl uses one or the other).
        kl_kind: the KL estimator in the reward (verl ``algorithm.kl_penalty``: ``kl``, i.e. k1).
        whiten_advantages: whiten the advantages over the batch's tokens (verl and TRL: yes).
        **kwargs: every :class:`GRPOModule` setting (``advantage`` must stay unset: GAE is the estimator).
    """

    config_groups = GRPOModule.config_groups + ("critic",)
    min_generations = 1

    def __init__(
        self,
        model_path: str,
        *,
        critic: ValueModelConfig = ValueModelConfig(),
        gamma: float = 1.0,
        lam: float = 1.0,
        kl_coef: float = 0.0,
        kl_kind: str = "kl",
        whiten_advantages: bool = True,
        **kwargs: Any,
    ) -> None:
        self.critic = as_config(critic, ValueModelConfig())  # set before the base class validates the settings
        super().__init__(model_path, **kwargs)
        c = self.critic
        dtype = getattr(torch, self.hparams.dtype)
        self.value_model = TokenValueModel.load(c.path or model_path, dtype=dtype, head_init_std=c.head_init_std,
                                                seed=self.hparams.seed)
        if c.lora_rank:
            settings = LoraSettings(r=c.lora_rank, alpha=c.lora_alpha, dropout=0.0, init_seed=1)
            if self.hparams.lora_target_modules is not None:
                settings.target_modules = list(self.hparams.lora_target_modules)
            self.value_model.backbone = wrap_with_lora(self.value_model.backbone, settings)
        if c.frozen:
            self.value_model.requires_grad_(False)
            self.value_model.eval()
        else:
            self.value_model.train()
        # the KL in the reward needs the reference even when the KL loss is off (beta 0)
        if self.hparams.kl_coef > 0 and self._reference[0] is None and not is_lora(self.model):
            ref_dtype = self.hparams.ref_dtype
            self._reference[0] = make_reference_model(
                self.model, self.hparams.kl_coef, dtype=None if ref_dtype is None else getattr(torch, ref_dtype))
        self._actor_params = [p for p in self.model.parameters() if p.requires_grad]
        # the actor and the critic clipped each to max_grad_norm (DPPO's pattern); the logged norm is both's
        self.update_engine = UpdateEngine(
            self, max_grad_norm=self.optim.max_grad_norm,
            clip_groups=lambda: [[p for p in self.model.parameters() if p.requires_grad],
                                 [p for p in self.value_model.parameters() if p.requires_grad]])

    def _validate_settings(self) -> None:
        super()._validate_settings()
        h = self.hparams
        require(0 < h.gamma <= 1, f"gamma must be in (0, 1], got {h.gamma}")
        require(0 <= h.lam <= 1, f"lam must be in [0, 1], got {h.lam}")
        require(h.kl_coef >= 0, f"kl_coef must be >= 0, got {h.kl_coef}")
        from mmpo.core import KL_KINDS

        require(h.kl_kind in KL_KINDS, f"kl_kind must be one of {list(KL_KINDS)}, got {h.kl_kind!r}")
        require(self.advantage == AdvantageConfig(),
                "PPO's advantages are GAE over the critic's values: leave `advantage` unset (set gamma / lam)")
        refuse_rollout_correction(self.rollout_correction)

    # ------------------------------------------------------------------ optimizer

    def configure_optimizers(self) -> dict[str, Any]:
        c = self.critic
        groups = [{"params": list(self.model.parameters())}]
        if not c.frozen:
            groups.append({"params": list(self.value_model.parameters()), "lr": c.lr, "weight_decay": c.weight_decay})
        return make_optimizer(groups, lr=self.optim.lr, weight_decay=self.optim.weight_decay, betas=self.optim.betas,
                              fused=True, warmup_steps=self.optim.warmup_steps, schedule=self.optim.lr_schedule,
                              total_steps=max_steps_or_none(self))

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.value_model.to(self.device)

    # ------------------------------------------------------------------ critic warm-up

    def critic_warmup(self, step: int) -> bool:
        """Whether optimizer step ``step`` trains the critic alone."""
        return not self.critic.frozen and step < self.critic.warmup_steps

    def begin_step(self, state: StepState) -> None:
        super().begin_step(state)
        warm = self.critic_warmup(state.step)
        for param in self._actor_params:
            param.requires_grad_(not warm)
        state.metrics["critic/warmup"] = float(warm)

    def end_step(self, state: StepState) -> None:
        for param in self._actor_params:
            param.requires_grad_(True)
        super().end_step(state)

    # ------------------------------------------------------------------ advantages

    @torch.no_grad()
    def rollout_values(self, rollout: Rollout) -> Tensor:
        """``(N, T)`` the value model's V(s_t) for every completion token, in micro-batches, on the CPU."""
        was_training = self.value_model.training
        self.value_model.eval()
        try:
            parts = [self.value_model(rollout.select(index).to(self.device)).cpu()
                     for index in torch.arange(len(rollout)).split(self.optim.micro_batch_size or len(rollout))]
        finally:
            self.value_model.train(was_training)
        return torch.cat(parts)

    def token_rewards(self, rewards: Tensor, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        """``(N, T)`` token rewards: the outcome at the last token, minus the KL when it is in the reward."""
        h = self.hparams
        mask = loss_mask(rollout).to(rewards.device)
        if not h.kl_coef:
            return outcome_token_rewards(rewards, mask)
        micro = self.optim.micro_batch_size or len(rollout)
        on_device = rollout.to(self.device)
        old = self._log_probs_no_grad(self.model, on_device, micro)
        with self.reference_policy() as reference:
            ref = self._log_probs_no_grad(reference, on_device, micro)
        return outcome_token_rewards(rewards, mask, old_log_probs=old.to(rewards), ref_log_probs=ref.to(rewards),
                                     kl_coef=h.kl_coef, kl_kind=h.kl_kind)

    def prepare_values(self, values: Tensor, mask: Tensor) -> Tensor:
        """Hook on the rollout-time values before GAE (DVPO whitens its frozen values). Default: as they are."""
        return values

    def compute_advantages(self, rewards: Tensor, group_ids: Tensor, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        """``(N, T)`` whitened GAE advantages; ``rollout.extras`` gets ``ppo_values`` and ``ppo_returns``."""
        h = self.hparams
        mask = loss_mask(rollout).to(rewards)
        token_rewards, metrics = self.token_rewards(rewards, rollout)
        values = self.prepare_values(self.rollout_values(rollout).to(rewards) * mask, mask)
        advantages, returns = token_gae(token_rewards, values, mask, gamma=h.gamma, lam=h.lam)
        rollout.extras["ppo_values"], rollout.extras["ppo_returns"] = values, returns * mask
        real = mask > 0
        if h.whiten_advantages and int(real.sum()) > 1:
            advantages = masked_whiten(advantages, mask)
        metrics.update({"critic/values_mean": float(values[real].mean()) if bool(real.any()) else 0.0,
                        "critic/returns_mean": float(returns[real].mean()) if bool(real.any()) else 0.0,
                        "critic/explained_variance": _explained_variance(values[real], returns[real])})
        return advantages * mask, metrics

    # ------------------------------------------------------------------ the value loss

    def extra_loss_terms(self, minibatch: Rollout, outputs: Mapping[str, Any]) -> tuple[LossParts, dict[str, Any]]:
        parts, metrics = super().extra_loss_terms(minibatch, outputs)
        parts = LossParts().update_from(parts) if not isinstance(parts, LossParts) else parts
        c = self.critic
        if c.frozen:
            return parts, dict(metrics)
        aggregation = outputs["aggregation"]
        values = self.value_model(minibatch)
        loss, value_metrics = value_loss(values, minibatch.extras["ppo_returns"].to(values),
                                         minibatch.extras["ppo_values"].to(values), outputs["mask"],
                                         clip=c.cliprange_value, agg="token-mean",
                                         global_tokens=aggregation.global_tokens)
        parts.add("value", loss, c.vf_coef)
        return parts, {**dict(metrics), **value_metrics}

    # ------------------------------------------------------------------ sharding, export

    def configure_model(self) -> None:
        super().configure_model()
        shard_value_model(self, self.value_model, frozen=self.critic.frozen)
        # FSDP2 replaces the policy's parameters by sharded ones: the warm-up must switch those off
        self._actor_params = [p for p in self.model.parameters() if p.requires_grad]

    def save_hf(self, output_dir: str | Path | None = None) -> Path | None:
        """The policy as GRPO's export; the trained critic beside it in ``<output_dir>/critic``."""
        # sharded: every rank takes part in gathering the critic's weights before rank 0 writes
        state = None if self.critic.frozen else self.value_model.full_state()
        written = super().save_hf(output_dir)
        if written is not None and state is not None:
            self.value_model.save(Path(written) / "critic", self.processor, state=state)
        return written


def _explained_variance(values: Tensor, returns: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the real tokens (verl's ``critic/vf_explained_var``); 0 when undefined."""
    if returns.numel() < 2:
        return 0.0
    var = returns.var()
    return float(1 - (returns - values).var() / var) if float(var) > 0 else 0.0
