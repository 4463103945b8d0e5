"""Typed, grouped settings of the policy-optimisation modules, one frozen dataclass per concern.

The VLM modules (``GRPOModule`` and its variants, ``INPOModule``, and through ``VLMPolicyModule``
every VLM module) take these as init arguments; LightningCLI (jsonargparse) parses them from nested
YAML, with the module's defaults for the fields a config leaves out and an error naming any unknown
field::

    model:
      class_path: mmpo.algos.grpo.GRPOModule
      init_args:
        model_path: runs/tiny_vlm
        sampling: {num_generations: 4, max_new_tokens: 64}
        loss: {name: ppo, clip_high: 0.28, beta: 0.0}
        optim: {lr: 1.0e-6, minibatch_size: 8}

On the command line: ``--model.init_args.sampling.num_generations=2``. Each dataclass checks its
own fields in ``__post_init__`` (``ValueError`` with the message the flat settings gave); checks
across groups (``loss.name`` against ``rollout_correction``, minibatch against the rollout size)
stay with the module. The field names follow verl / TRL where one exists (docs/grpo.md has the
old flat name of each field). Modules keep them in checkpoints as plain dicts (:func:`as_config`
reads either form back), so checkpoints load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class SamplingConfig:
    """How rollouts are sampled (TRL's generation settings, verl's ``rollout.n`` / ``response_length``).

    Attributes:
        num_generations: completions sampled per prompt (G; group-relative modules need >= 2).
        max_new_tokens: maximum completion length in tokens.
        temperature: sampling temperature (log-probs use the same temperature).
        top_p: nucleus sampling threshold (1.0 = off).
        val_max_new_tokens: completion length for greedy validation; None = max_new_tokens.
    """

    num_generations: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    val_max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        _require(self.num_generations >= 1, f"num_generations must be >= 1, got {self.num_generations}")
        _require(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _require(self.temperature > 0, f"temperature must be > 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _require(self.val_max_new_tokens is None or self.val_max_new_tokens >= 1,
                 f"val_max_new_tokens must be >= 1 or None, got {self.val_max_new_tokens}")


@dataclass(frozen=True)
class LossConfig:
    """The policy loss and the terms added to it (verl's ``actor`` loss settings, TRL's ``loss_type``).

    Attributes:
        name: policy loss name in mmpo.core (ppo, gspo, gmpo, gppo, dcpo, aspo, cispo, sapo, gpg, clip_cov, kl_cov, luspo, vespo; docs/core.md).
        clip_low: lower clip range epsilon (ratio >= 1 - clip_low); None = the loss's own default (ppo 0.2, gspo 3e-4).
        clip_high: upper clip range epsilon; None = the loss's default (ppo 0.2; EasyR1 uses 0.3, DAPO 0.28).
        dual_clip: dual-clip constant c for negative advantages (e.g. 3.0); None disables.
        settings: further keyword settings for the policy loss (e.g. GSPO/CISPO options).
        agg: loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm.
        norm_len: the constant L of seq-mean-token-sum-norm (Dr.GRPO divides by sequences x L); None = sampling.max_new_tokens (the paper, TRL's dr_grpo), never the step's padded width.
        kl_kind: KL estimator: k1, k2, k3, abs, verl's aliases kl, mse, low_var_kl, or a straight-through k1+ / k3+ / ... (docs/core.md, KL).
        beta: coefficient of the KL penalty to the reference (initial) policy; 0 builds no reference (with LoRA the reference is the adapter-disabled policy).
        entropy_coef: entropy bonus coefficient (0 = off, as the GRPO paper).
    """

    name: str = "ppo"
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = None
    settings: dict[str, Any] | None = None
    agg: str = "token-mean"
    norm_len: int | None = None
    kl_kind: str = "k3"
    beta: float = 0.01
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        from mmpo.core import AGGREGATION_MODES, KL_KINDS, POLICY_LOSSES

        _require(self.beta >= 0, f"beta must be >= 0, got {self.beta}")
        _require(self.kl_kind in KL_KINDS, f"unknown kl_kind {self.kl_kind!r}; valid: {list(KL_KINDS)}")
        _require(self.name in POLICY_LOSSES, f"unknown loss {self.name!r}; valid: {POLICY_LOSSES.names()}")
        _require(self.agg in AGGREGATION_MODES, f"unknown agg {self.agg!r}; valid: {list(AGGREGATION_MODES)}")
        _require(self.norm_len is None or self.norm_len >= 1, f"norm_len must be >= 1 or None, got {self.norm_len}")
        _require(self.clip_low is None or 0 <= self.clip_low < 1, f"clip_low must be in [0, 1), got {self.clip_low}")
        _require(self.clip_high is None or self.clip_high >= 0, f"clip_high must be >= 0, got {self.clip_high}")
        _require(self.dual_clip is None or self.dual_clip > 1, f"dual_clip must be > 1 or None, got {self.dual_clip}")
        _require(self.entropy_coef >= 0, f"entropy_coef must be >= 0, got {self.entropy_coef}")


@dataclass(frozen=True)
class AdvantageConfig:
    """The advantage estimator and the group filter before the loss (verl's ``algorithm.adv_estimator``).

    Attributes:
        name: advantage estimator name in mmpo.core (grpo, drgrpo, rloo, mapo, reinforce_plus_plus, opo, grpo_passk, gpg, remax, optimal_token_baseline, ...; docs/core.md).
        eps: epsilon added to the group std (estimators that take eps); None = estimator default.
        dynamic_sampling: DAPO dynamic sampling: groups whose rewards all agree are masked out of the loss.
        dynamic_sampling_retries: with dynamic_sampling, sample such groups' prompts again up to this many times.
        settings: further keyword settings of the estimator (e.g. reinforce_plus_plus's gamma); eps goes in ``eps``.
    """

    name: str = "grpo"
    eps: float | None = 1e-6
    dynamic_sampling: bool = False
    dynamic_sampling_retries: int = 0
    settings: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        from mmpo.core import ADVANTAGE_ESTIMATORS

        _require(self.name in ADVANTAGE_ESTIMATORS,
                 f"unknown advantage {self.name!r}; valid: {ADVANTAGE_ESTIMATORS.names()}")
        _require(self.dynamic_sampling_retries >= 0,
                 f"dynamic_sampling_retries must be >= 0, got {self.dynamic_sampling_retries}")
        # one place for eps: a second one in settings would silently override it
        _require("eps" not in (self.settings or {}), "advantage settings must not hold eps; set advantage.eps")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, its learning-rate schedule and the update loop over a rollout (verl's ``actor.optim`` / ``ppo_*``).

    Attributes:
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW's (beta1, beta2) moment decay rates (torch's default 0.9, 0.999; IGPO / d1 use 0.9, 0.99).
        warmup_steps: linear learning-rate warm-up, in optimizer steps.
        lr_schedule: after warm-up: constant, linear or cosine decay to trainer.max_steps.
        max_grad_norm: gradient clipping norm; 0 disables clipping.
        mu: inner PPO epochs over each rollout batch.
        minibatch_size: completions per optimizer step (must divide prompts x G); None = the whole rollout.
        micro_batch_size: completions per forward/backward (gradient accumulation); None = minibatch_size.
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    max_grad_norm: float = 1.0
    mu: int = 1
    minibatch_size: int | None = None
    micro_batch_size: int | None = None

    def __post_init__(self) -> None:
        from mmpo.training.lr_schedule import SCHEDULES

        _require(self.lr > 0, f"lr must be > 0, got {self.lr}")
        _require(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        # a YAML list or a checkpoint's list comes in as a list: kept as a tuple so equal settings compare equal
        object.__setattr__(self, "betas", tuple(self.betas))
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                 f"betas must be two values in [0, 1), got {list(self.betas)}")
        _require(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        _require(self.lr_schedule in SCHEDULES, f"unknown schedule {self.lr_schedule!r}; valid: {list(SCHEDULES)}")
        _require(self.max_grad_norm >= 0, f"max_grad_norm must be >= 0, got {self.max_grad_norm}")
        _require(self.mu >= 1, f"mu (inner epochs) must be >= 1, got {self.mu}")
        for name in ("minibatch_size", "micro_batch_size"):
            value = getattr(self, name)
            _require(value is None or value >= 1, f"{name} must be >= 1 or None, got {value}")
        if self.minibatch_size is not None and self.micro_batch_size is not None:
            _require(self.minibatch_size % self.micro_batch_size == 0,
                     f"micro_batch_size {self.micro_batch_size} must divide minibatch_size {self.minibatch_size}; "
                     f"valid: {[d for d in range(1, self.minibatch_size + 1) if self.minibatch_size % d == 0]}")


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Importance-sampling correction between the rollout engine's and the trainer's log-probs (verl's ``rollout_is``).

    Attributes:
        mode: None (off), token_truncate, token_mask, sequence_truncate, sequence_mask (TRL vllm_importance_sampling_mode); the weight multiplies the per-token policy loss.
        cap: upper bound C of the IS weight (truncate: clamp at C; mask: zero above C); verl's 2.0.
        cap_low: optional lower bound of the IS weight (TRL's clip_min); None = none.
        bypass: verl's bypass mode: the engine's log-probs are the old log-probs (no old-log-prob pass); with a mode it needs the ratio-free loss gpg.
    """

    mode: str | None = None
    cap: float = 2.0
    cap_low: float | None = None
    bypass: bool = False

    def __post_init__(self) -> None:
        from mmpo.core import check_rollout_is

        check_rollout_is(self.mode, self.cap, self.cap_low)

    @property
    def needs_engine_log_probs(self) -> bool:
        """Whether the rollout engine must return the sampled tokens' log-probs."""
        return self.mode is not None or self.bypass


@dataclass(frozen=True)
class EngineConfig:
    """Who samples the rollouts (TRL's ``use_vllm`` / ``vllm_*``, verl's ``rollout.name``).

    Attributes:
        name: hf (HF generate on the policy itself) or vllm (a vLLM engine colocated in this process, weights synced after every optimizer step; needs full fine-tuning and no FSDP2; docs/vllm.md).
        vllm_max_model_len: with vllm: prompt + completion tokens per sequence vLLM plans for.
        vllm_max_num_batched_tokens: with vllm: tokens per vLLM scheduler step, at least one step's prompt tokens (vLLM's CPU backend cannot split a seeded prefill).
        vllm_gpu_memory_utilization: with vllm on a GPU: vLLM's share of its memory.
    """

    name: str = "hf"
    vllm_max_model_len: int = 4096
    vllm_max_num_batched_tokens: int = 16384
    vllm_gpu_memory_utilization: float = 0.3

    def __post_init__(self) -> None:
        _require(self.name in ("hf", "vllm"), f"rollout_engine must be hf or vllm, got {self.name!r}")


@dataclass(frozen=True)
class RewardConfig:
    """The reward functions and how they are called (TRL's ``reward_funcs`` / ``reward_weights``).

    Attributes:
        weights: reward -> weight; None = accuracy 0.9, format 0.1. A reward is a registered name or your own function, ``path/to/file.py:fn`` or ``package.module:fn`` (docs/grpo.md).
        timeout_s: per reward-function call deadline in seconds (a hang gives zeros); None = inline, no deadline.
        models: model rewards by name: reward-model checkpoints (``kind: classifier``) and generative judges
            (``kind: judge``), each weighted in ``weights`` under its name (docs/rewards.md, ``mmpo.rewards.models``).
    """

    weights: dict[str, float] | None = None
    timeout_s: float | None = 10.0
    models: dict[str, dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        _require(self.timeout_s is None or self.timeout_s > 0, f"reward_timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class CriticConfig:
    """A learned value function (critic) trained beside the actor (verl's ``critic``; DPPO's critic settings).

    Attributes:
        lr: the critic's AdamW learning rate (its weight decay is optim.weight_decay).
        vf_coef: coefficient of the value loss (0.5 x MSE to the GAE returns) in the total loss.
        warmup_iterations: first iterations that train only the critic (the actor is not stepped).
        hidden_dims: hidden widths of the critic MLP; None = [256, 256, 256].
    """

    lr: float = 1e-3
    vf_coef: float = 0.5
    warmup_iterations: int = 2
    hidden_dims: list[int] | None = None

    def __post_init__(self) -> None:
        _require(self.lr > 0, f"lr must be > 0, got {self.lr}")
        _require(self.vf_coef >= 0, f"vf_coef must be >= 0, got {self.vf_coef}")
        _require(self.warmup_iterations >= 0, f"warmup_iterations must be >= 0, got {self.warmup_iterations}")
        _require(self.hidden_dims is None or (len(self.hidden_dims) >= 1 and min(self.hidden_dims) >= 1),
                 f"hidden_dims must be a non-empty list of widths >= 1 or None, got {self.hidden_dims}")


@dataclass(frozen=True)
class ValueModelConfig:
    """The critic of PPO for language and vision-language models: a value model (a backbone and a scalar head
    on its final hidden states) beside the policy (verl's ``critic``; mmpo.algos.ppo, docs/ppo.md).

    Attributes:
        path: saved HF model the value model's backbone is loaded from; None = the policy's ``model_path``
            (verl's ``critic.model.path`` defaults to the actor's).
        lr: the critic's AdamW learning rate (verl ``critic.optim.lr``: 1e-5).
        weight_decay: the critic's AdamW weight decay (verl ``critic.optim.weight_decay``: 0.01).
        vf_coef: coefficient of the value loss (its parameters are the critic's alone, so this scales only
            the critic's gradient; verl trains the critic on its own loss: 1.0).
        cliprange_value: value clipping around the rollout-time values (verl ``critic.cliprange_value``: 0.5);
            None = no clipping.
        warmup_steps: the first optimizer steps train only the critic (verl ``trainer.critic_warmup``: 0).
        frozen: the value model is not trained (DVPO's pretrained global value model): no value loss, no
            optimizer group.
        head_init_std: std of the normal initialisation of the scalar head's weight (bias 0); 0 = zeros
            (transformers' ``initializer_range``: 0.02). A ``path`` saved by mmpo with ``value_head.pt`` loads
            its head instead.
        lora_rank: train a LoRA adapter of this rank on the critic's backbone (head trained fully); 0 = full.
        lora_alpha: the critic adapter's scaling numerator.
    """

    path: str | None = None
    lr: float = 1e-5
    weight_decay: float = 0.01
    vf_coef: float = 1.0
    cliprange_value: float | None = 0.5
    warmup_steps: int = 0
    frozen: bool = False
    head_init_std: float = 0.02
    lora_rank: int = 0
    lora_alpha: int = 64

    def __post_init__(self) -> None:
        _require(self.lr > 0, f"critic lr must be > 0, got {self.lr}")
        _require(self.weight_decay >= 0, f"critic weight_decay must be >= 0, got {self.weight_decay}")
        _require(self.vf_coef >= 0, f"critic vf_coef must be >= 0, got {self.vf_coef}")
        _require(self.cliprange_value is None or self.cliprange_value > 0,
                 f"critic cliprange_value must be > 0 or null, got {self.cliprange_value}")
        _require(self.warmup_steps >= 0, f"critic warmup_steps must be >= 0, got {self.warmup_steps}")
        _require(self.head_init_std >= 0, f"critic head_init_std must be >= 0, got {self.head_init_std}")
        _require(self.lora_rank >= 0, f"critic lora_rank must be >= 0, got {self.lora_rank}")


def as_config(value: T | Mapping[str, Any] | None, default: T) -> T:
    """``value`` as an instance of ``default``'s class: ``default`` for None, ``default`` with the given
    fields replaced for a dict (a checkpoint's saved hyperparameters, or a short form in Python)."""
    if value is None:
        return default
    if isinstance(value, Mapping):
        return dataclasses.replace(default, **dict(value))
    if not isinstance(value, type(default)):
        raise TypeError(f"expected {type(default).__name__}, a dict of its fields or None, got {type(value).__name__}")
    return value


def plain_hparams(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """``hparams`` with every dataclass value as a dict (checkpoints load with ``weights_only=True``)."""
    return {key: dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type)
            else value for key, value in hparams.items()}


GROUPS: dict[str, type] = {
    "sampling": SamplingConfig, "loss": LossConfig, "advantage": AdvantageConfig, "optim": OptimConfig,
    "rollout_correction": RolloutCorrectionConfig, "rollout_engine": EngineConfig, "rewards": RewardConfig,
}
"""Init argument name -> config class, for the modules that take every group (``GRPOModule`` and its variants)."""


def merged_settings(*layers: Mapping[str, Any], groups: Mapping[str, type] = GROUPS) -> dict[str, Any]:
    """Module init arguments from ``layers``, later layers winning; a config group (a dict of fields or a
    config instance) in several layers is merged field by field, so ``merged_settings(defaults, {"optim":
    {"mu": 2}})`` keeps the other optim fields of ``defaults``. Groups come out as dicts (the modules take them).
    ``groups``: the init arguments that are groups (the dLLM module's: ``mmpo.dllm.config.DLLM_GROUPS``)."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key in groups and value is not None:
                fields = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else dict(value)
                out[key] = {**(out.get(key) or {}), **fields}
            else:
                out[key] = value
    return out
