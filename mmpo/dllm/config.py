"""Typed, grouped settings of the masked-diffusion modules (``DiffuGRPO`` and its variants, ``MaskedDiffusionSFT``).

The concerns every family shares use the shared dataclasses of :mod:`mmpo.training.config` (``loss``,
``advantage``, ``optim``, ``rewards``), with this family's defaults as module default instances
(:data:`DIFFU_GRPO_LOSS` ...; a YAML group sets some fields over them). The dLLM-only concerns are the
dataclasses here: how completion log-probs are estimated (:class:`DiffusionLogProbConfig`) and IGPO's
inpainting (:class:`InpaintingConfig`); the rollout sampler (``SamplerConfig``) and the hint construction
(``HintConfig``) keep their own modules. docs/dllm.md has the old flat name of every field, and
:func:`grouped_hparams` turns a checkpoint's flat hyperparameters into the groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from mmpo.training.config import AdvantageConfig, LossConfig, OptimConfig, RewardConfig


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


MASKINGS = ("full", "structured")


@dataclass(frozen=True)
class DiffusionLogProbConfig:
    """How the policy's per-token completion log-probs are estimated from the mask predictor (d1 / IGPO).

    Attributes:
        masking: full (the one-pass estimator: every completion token masked; IGPO's official run, d1_masking true) or structured (IGPO's d1_masking false path: inner update n masks each completion token with probability t_n / T and scores only those).
        p_mask_prompt: probability of masking each prompt token while scoring (IGPO 0; d1 0.15); one seed per inner update.
        diffusion_steps: T of the structured schedule (IGPO 128).
        min_timestep: smallest timestep t_0 of the structured schedule (IGPO 30); needs 1 <= min_timestep <= diffusion_steps - 2.
        chunk_size: rows per chunk of the log-softmax (memory, not results).
    """

    masking: str = "full"
    p_mask_prompt: float = 0.0
    diffusion_steps: int = 128
    min_timestep: int = 30
    chunk_size: int = 1024

    def __post_init__(self) -> None:
        _require(self.masking in MASKINGS, f"masking must be 'full' or 'structured', got {self.masking!r}")
        _require(0 <= self.p_mask_prompt <= 1, f"p_mask_prompt must be in [0, 1], got {self.p_mask_prompt}")
        if self.masking == "structured":  # the schedule is only drawn under structured masking
            _require(1 <= self.min_timestep <= self.diffusion_steps - 2,
                     f"need 1 <= min_timestep <= diffusion_steps - 2, got {self.min_timestep} and {self.diffusion_steps}")
        _require(self.chunk_size >= 1, f"chunk_size must be >= 1, got {self.chunk_size}")


@dataclass(frozen=True)
class InpaintingConfig:
    """IGPO's inpainting: all-wrong groups regenerated with hints from their reference trace (arXiv 2509.10396).

    Attributes:
        enabled: regenerate all-wrong groups with hints (false = the diffu-GRPO baseline of d1).
        max_replacements: at most this many correct hinted rollouts replace original ones in a group (IGPO 4 of 8).
        entropy_keep: fraction of hint tokens kept in the loss, those of highest old-policy entropy (IGPO 0.2).
    """

    enabled: bool = True
    max_replacements: int = 4
    entropy_keep: float = 0.2

    def __post_init__(self) -> None:
        _require(self.max_replacements >= 0, f"max_replacements must be >= 0, got {self.max_replacements}")
        _require(0 < self.entropy_keep <= 1, f"entropy_keep must be in (0, 1], got {self.entropy_keep}")


CORRECTNESS_REWARD = "correct"
"""The reward name of the correctness reward in ``rewards.weights`` (it alone decides IGPO's hinting)."""

# DiffuGRPO's defaults: IGPO's official run (docs/dllm.md), as the flat settings had them
DIFFU_GRPO_LOSS = LossConfig(name="igpo_sequence", clip_low=0.2, clip_high=0.2, beta=0.01, kl_kind="k3",
                             agg="token-mean")
DIFFU_GRPO_ADVANTAGE = AdvantageConfig(name="drgrpo", eps=None)  # eps None: the estimator's own default
DIFFU_GRPO_OPTIM = OptimConfig(lr=5e-7, weight_decay=0.1, betas=(0.9, 0.99), warmup_steps=50,
                               lr_schedule="constant", max_grad_norm=0.2, mu=4)
DIFFU_GRPO_REWARDS = RewardConfig(weights={CORRECTNESS_REWARD: 1.0}, timeout_s=10.0)
DIFFU_GRPO_LOGPROB = DiffusionLogProbConfig()
DIFFU_GRPO_INPAINTING = InpaintingConfig()
# MaskedDiffusionSFT's: the gradient is clipped by the trainer (gradient_clip_val), not the module
SFT_OPTIM = OptimConfig(lr=1e-3, weight_decay=0.01, warmup_steps=50, max_grad_norm=0.0)

DLLM_GROUPS: dict[str, type] = {
    "loss": LossConfig, "advantage": AdvantageConfig, "optim": OptimConfig, "rewards": RewardConfig,
    "logprob": DiffusionLogProbConfig, "igpo": InpaintingConfig,
}
"""Init argument name -> config class of ``DiffuGRPO`` (``merged_settings(..., groups=DLLM_GROUPS)``)."""

# ratio_level of the flat settings -> the core loss it selected (mmpo.dllm.igpo.CORE_LOSS)
_RATIO_LEVEL_LOSS = {"token": "ppo", "sequence": "igpo_sequence", "sequence_masked": "gspo"}
# flat name -> (group, field) of the moves that only rename
_FLAT_TO_GROUP: dict[str, tuple[str, str]] = {
    "inner_updates": ("optim", "mu"), "lr": ("optim", "lr"), "weight_decay": ("optim", "weight_decay"),
    "betas": ("optim", "betas"), "warmup_steps": ("optim", "warmup_steps"), "lr_schedule": ("optim", "lr_schedule"),
    "max_grad_norm": ("optim", "max_grad_norm"),
    "beta": ("loss", "beta"), "kl_kind": ("loss", "kl_kind"), "clip_low": ("loss", "clip_low"),
    "clip_high": ("loss", "clip_high"), "loss_agg": ("loss", "agg"), "loss_settings": ("loss", "settings"),
    "entropy_coef": ("loss", "entropy_coef"),
    "advantage_settings": ("advantage", "settings"),
    "masking": ("logprob", "masking"), "p_mask_prompt": ("logprob", "p_mask_prompt"),
    "diffusion_steps": ("logprob", "diffusion_steps"), "min_timestep": ("logprob", "min_timestep"),
    "logprob_chunk_size": ("logprob", "chunk_size"),
    "reward_timeout_s": ("rewards", "timeout_s"),
    "max_replacements": ("igpo", "max_replacements"), "entropy_keep": ("igpo", "entropy_keep"),
}
# flat names whose value moves with a change of meaning (handled in grouped_hparams)
_FLAT_SPECIAL = ("ratio_level", "correct_reward", "format_reward")


def is_flat_hparams(hparams: Mapping[str, Any]) -> bool:
    """Whether ``hparams`` (a checkpoint's) has the flat settings of before the groups: a flat name, or
    ``loss`` / ``advantage`` / ``igpo`` as the old plain values (a name, a bool) instead of groups."""
    if any(key in hparams for key in (*_FLAT_TO_GROUP, *_FLAT_SPECIAL)):
        return True
    return any(key in hparams and not isinstance(hparams[key], (Mapping, type(None)))
               for key in ("loss", "advantage", "igpo"))


def grouped_hparams(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """A dLLM checkpoint's flat hyperparameters (``DiffuGRPO(lr=..., beta=..., ratio_level=...)``,
    ``MaskedDiffusionSFT(lr=...)``) as the grouped init arguments of today (docs/dllm.md has the table).

    Groups come out as dicts of the fields the checkpoint had (the module's defaults fill the rest, as
    :func:`mmpo.training.config.as_config` reads them); other keys pass unchanged. ``ratio_level`` and the
    old ``loss`` name become ``loss.name``; ``correct_reward`` / ``format_reward`` become ``rewards.weights``
    ({correct: correct_reward, <format_reward>: 1.0}); ``igpo: bool`` becomes ``igpo.enabled``."""
    from mmpo.dllm.igpo import resolve_loss

    out: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for key, value in hparams.items():
        if key in _FLAT_TO_GROUP:
            group, field = _FLAT_TO_GROUP[key]
            groups.setdefault(group, {})[field] = list(value) if key == "betas" else value
        elif key in ("loss", "advantage", "igpo") and isinstance(value, Mapping):
            groups.setdefault(key, {}).update(value)  # already grouped
        elif key not in (*_FLAT_SPECIAL, "loss", "advantage", "igpo"):
            out[key] = value
    if "ratio_level" in hparams or isinstance(hparams.get("loss"), str):
        groups.setdefault("loss", {})["name"] = resolve_loss(hparams.get("ratio_level", "sequence"),
                                                             hparams.get("loss") if isinstance(hparams.get("loss"), str) else None)
    if isinstance(hparams.get("advantage"), str):
        groups.setdefault("advantage", {})["name"] = hparams["advantage"]
    settings = dict(groups.get("advantage", {}).get("settings") or {})
    if "eps" in settings:  # eps has its own field now
        groups["advantage"]["eps"] = settings.pop("eps")
        groups["advantage"]["settings"] = settings or None
    if isinstance(hparams.get("igpo"), bool):
        groups.setdefault("igpo", {})["enabled"] = hparams["igpo"]
    if "correct_reward" in hparams or hparams.get("format_reward") is not None:
        weights = {CORRECTNESS_REWARD: float(hparams.get("correct_reward", 1.0))}
        if hparams.get("format_reward") is not None:
            weights[hparams["format_reward"]] = 1.0
        groups.setdefault("rewards", {})["weights"] = weights
    return {**out, **groups}

