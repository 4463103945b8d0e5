"""mmpo.core: the shared advantage / clipping core (pure torch, no model or framework imports).

Pieces (each a pure function behind a name registry where there are variants):

- advantages: :func:`compute_advantages` (``grpo``, ``drgrpo``, ``rloo``, ``mapo``,
  ``mapo_apd``, ``mapo_random_lambda``), :func:`gae`; verl's estimators (``reinforce_plus_plus``,
  ``reinforce_plus_plus_baseline``, ``opo``, ``grpo_passk``, ``gpg``, ``remax``,
  ``optimal_token_baseline``, ``tir_optimal_token_baseline``) in
  :mod:`mmpo.core.advantages_verl`; ``pvpo`` (static baseline) in :mod:`mmpo.core.advantages_pvpo`; ``hbpo``
  (budget subgroups) in :mod:`mmpo.core.advantages_hbpo`;
  structured-rollout estimators ``brpo``
  (:mod:`~mmpo.core.advantages_budget`), ``treepo`` and ``segment`` (:mod:`~mmpo.core.advantages_tree`),
  ``tppo`` (:mod:`~mmpo.core.advantages_truncated`).
- policy losses: :func:`policy_loss` (``ppo``, ``gspo``, ``gmpo``, ``gppo``, ``dcpo``,
  ``aspo``, ``cispo``, ``igpo_sequence``, and verl / TRL's ``sapo``, ``gpg``, ``clip_cov``,
  ``kl_cov``, ``luspo``, ``vespo``) returning ``(loss, metrics)``; new ones state only
  their ratio / clip rule (:func:`register_ratio_loss`). :class:`LossParts`: named loss terms
  summed in one place.
- :func:`aggregate` (``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``,
  ``seq-mean-token-sum-norm``), :func:`kl_penalty` (``k1``, ``k2``, ``k3``, ``abs``; verl's
  ``kl``, ``mse``, ``low_var_kl``).
- memory-efficient :func:`token_log_probs`, :func:`entropy_from_logits`,
  :func:`token_log_probs_from_hidden`.
- rollout correction: :func:`rollout_is_weights` (truncated / masked token- or sequence-level
  IS weights between the rollout engine's and the trainer's log-probs; TRL / verl).
- preference losses: :func:`preference_loss` (``sigmoid`` DPO / cDPO, ``ipo``, ``robust``, ``hinge``;
  ``rpo_alpha``: + the chosen NLL, :func:`chosen_nll`) and :func:`inpo_loss` (INPO) on sequence
  log-probs, with TRL's ``rewards/*`` metrics.
- PPO with a critic on tokens (:mod:`mmpo.core.value`): :func:`outcome_token_rewards`, :func:`token_gae`,
  :func:`value_loss` (clipped).
- filters (:func:`dynamic_sampling_filter`, :func:`gfpo_filter`, :func:`lspo_filter`) and shaping
  (:func:`overlong_soft_punishment`, :func:`dither_rewards`).
"""

from mmpo.core.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    compute_advantages,
    compute_advantages_with_metrics,
    min_group_size,
    gae,
    register_advantage_estimator,
)
from mmpo.core.advantages_verl import VERL_ADVANTAGE_ESTIMATORS  # registers verl's estimators
from mmpo.core.advantages_pvpo import pvpo_advantages  # registers pvpo
from mmpo.core.advantages_hbpo import hbpo_advantages, hbpo_rewards  # registers hbpo
from mmpo.core import advantages_budget, advantages_tree, advantages_truncated  # registers brpo, treepo, segment, tppo
from mmpo.core.aggregate import AGGREGATION_MODES, AggregationMode, aggregate
from mmpo.core.filters import FilterResult, GFPOMetric, dynamic_sampling_filter, gfpo_filter, lspo_filter
from mmpo.core.groups import GroupIndex, build_group_index
from mmpo.core.hapo import EntropyNormStats, adaptive_temperature, hapo_entropy_norm  # registers 'hapo'
from mmpo.core.kl import KL_KINDS, KLKind, kl_penalty
from mmpo.core.loss_parts import LossParts, as_loss_parts
from mmpo.core.logprobs import entropy_from_logits, token_log_probs, token_log_probs_from_hidden
from mmpo.core.masked import masked_mean, masked_sum, masked_var, masked_whiten
from mmpo.core.value import last_token_index, outcome_token_rewards, token_gae, value_loss
from mmpo.core.policy_loss import (
    POLICY_LOSSES,
    Aggregation,
    PolicyLoss,
    RatioInputs,
    TokenLoss,
    check_clip_range,
    dcpo_ratio_bounds,
    policy_loss,
    policy_loss_reads_entropy,
    ppo_clip,
    register_policy_loss,
    register_ratio_loss,
)
from mmpo.core.policy_loss_peers import BATCH_COUPLED_LOSSES  # registers the verl / TRL losses
from mmpo.core.preference import (
    PREFERENCE_LOSSES,
    check_inpo_settings,
    check_preference_settings,
    chosen_nll,
    implicit_reward_metrics,
    inpo_loss,
    preference_loss,
)
from mmpo.core.registry import Registry
from mmpo.core.rollout_correction import (
    ROLLOUT_IS_MODES,
    bypass_old_log_probs,
    check_rollout_is,
    rollout_is_weights,
)
from mmpo.core.shaping import DitherDistribution, dither_rewards, overlong_soft_punishment

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "BATCH_COUPLED_LOSSES",
    "AGGREGATION_MODES",
    "Aggregation",
    "AggregationMode",
    "AdvantageEstimator",
    "DitherDistribution",
    "FilterResult",
    "GFPOMetric",
    "EntropyNormStats",
    "GroupIndex",
    "KLKind",
    "KL_KINDS",
    "LossParts",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "PolicyLoss",
    "RatioInputs",
    "ROLLOUT_IS_MODES",
    "Registry",
    "TokenLoss",
    "VERL_ADVANTAGE_ESTIMATORS",
    "as_loss_parts",
    "adaptive_temperature",
    "aggregate",
    "build_group_index",
    "bypass_old_log_probs",
    "check_inpo_settings",
    "check_preference_settings",
    "check_rollout_is",
    "chosen_nll",
    "check_clip_range",
    "compute_advantages",
    "compute_advantages_with_metrics",
    "min_group_size",
    "dcpo_ratio_bounds",
    "dither_rewards",
    "dynamic_sampling_filter",
    "entropy_from_logits",
    "gae",
    "gfpo_filter",
    "hapo_entropy_norm",
    "implicit_reward_metrics",
    "inpo_loss",
    "kl_penalty",
    "lspo_filter",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "last_token_index",
    "outcome_token_rewards",
    "token_gae",
    "value_loss",
    "overlong_soft_punishment",
    "policy_loss",
    "policy_loss_reads_entropy",
    "preference_loss",
    "ppo_clip",
    "register_advantage_estimator",
    "register_policy_loss",
    "register_ratio_loss",
    "rollout_is_weights",
    "token_log_probs",
    "token_log_probs_from_hidden",
]
