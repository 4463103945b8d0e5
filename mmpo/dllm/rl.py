"""diffu-GRPO and IGPO for masked-diffusion LMs as one Lightning module.

One training step (IGPO, arXiv 2509.10396, Algorithm 1 / ``facebookresearch/igpo:trainer_igpo.py``;
with ``igpo.enabled: false`` it is the diffu-GRPO baseline of d1, arXiv 2504.12216, as in IGPO's
``trainer_baseline.py``):

1. roll out G completions per prompt with the LLaDA block sampler (temperature tau);
2. score them with the correctness reward;
3. IGPO only: every group whose rollouts are all wrong is regenerated with hints from its
   reference trace (``mmpo.dllm.hints``; hint positions fixed during denoising), and up to
   ``igpo.max_replacements`` correct hinted rollouts replace original ones;
4. advantages r - mean over the (mixed) group (core ``drgrpo``; ``advantage.name`` picks any core estimator
   whose inputs exist here: ``remax`` adds one greedy rollout per prompt for its baseline);
5. old and reference log-probs (+ old entropies) by the one-pass estimator
   (completion fully masked; prompt masked with ``logprob.p_mask_prompt``, one seed per inner step),
   or with ``logprob.masking: structured`` by IGPO's structured estimator (inner step n masks each
   completion token with probability t_n / T; only masked positions enter the loss);
6. IGPO only: keep only the top ``igpo.entropy_keep`` fraction of hint tokens by old entropy;
7. ``optim.mu`` optimizer steps on the clipped loss + beta * k3 KL (``loss.name`` / ``loss.kl_kind``
   select any core policy loss / KL estimator).

Metrics (the shared vocabulary of docs/core.md): ``rewards/correct/mean`` (sampled rollouts),
``rewards/total/mean`` (after replacement, format reward included), ``rewards/format/mean`` (with a format reward),
``igpo/frac_all_wrong_sampled`` (groups all wrong before hints),
``igpo/frac_all_wrong`` (after replacement: groups that give no learning signal),
``igpo/num_replaced``, ``igpo/hinted_accuracy``, ``rewards/correct/errors``, ``/timeouts`` and
``/verify_errors`` (scoring calls that failed or missed ``rewards.timeout_s``; answers math-verify
raised on), ``perf/reward_worker_restarts``, ``losses/policy``, ``losses/kl``,
``policy/*`` from the core, ``perf/skipped_steps``, ``lr``, ``val/accuracy`` (greedy, held out).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from mmpo.dllm.checkpoint_hparams import LegacyHparamsMixin, PlainHparamsMixin, as_config
from mmpo.dllm.config import (
    CORRECTNESS_REWARD,
    DIFFU_GRPO_ADVANTAGE,
    DIFFU_GRPO_INPAINTING,
    DIFFU_GRPO_LOGPROB,
    DIFFU_GRPO_LOSS,
    DIFFU_GRPO_OPTIM,
    DIFFU_GRPO_REWARDS,
    DiffusionLogProbConfig,
    InpaintingConfig,
)
from mmpo.dllm.export_hooks import MaskPredictorExportHooks
from mmpo.dllm.hints import HintConfig, build_group_hints
from mmpo.dllm.igpo import (
    DEFAULT_RATIO_LEVEL,
    all_wrong_groups,
    check_loss_choice,
    choose_replacements,
    hint_entropy_filter,
    igpo_loss_parts,
)
from mmpo.dllm.logprobs import completion_log_probs, perturb_for_scoring, structured_timesteps
from mmpo.training.lora import LoraSettings, wrap_with_lora
from mmpo.dllm.modeling import load_mask_predictor, mask_token_id
from mmpo.dllm.rewards import FORMAT_REWARDS, correctness_rewards_with_deadline, format_rewards
from mmpo.dllm.rollout import rollout
from mmpo.dllm.sampler import SamplerConfig
from mmpo.core import ADVANTAGE_ESTIMATORS, LossParts, compute_advantages_with_metrics, policy_loss_reads_entropy
from mmpo.training.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS, NonFiniteGuard, NonFiniteGuardMixin
from mmpo.training.step_state import StepState
from mmpo.training.completions import CompletionSamples
from mmpo.training.update import MicroLoss, PassContext, UpdateEngine, UpdateSchedule, UpdateWrapper
from mmpo.training.update import micro_batch_metrics, total_loss
from mmpo.training.config import AdvantageConfig, LossConfig, OptimConfig, RewardConfig
from mmpo.training.config import as_config as as_group  # a group over the module's default instance
from mmpo.training.optim import make_optimizer, max_steps_or_none


# inputs of core advantage estimators that this module provides (see DiffuGRPO.compute_advantages)
PROVIDED_ESTIMATOR_INPUTS = {
    "mask": "the completion mask (all gen_length positions)",
    "reward_baselines": "the reward of one greedy rollout per prompt (ReMax)",
}


def estimator_inputs(name: str) -> set[str]:
    """Names of the required keyword inputs of core advantage estimator ``name`` (``mask``, ...)."""
    params = inspect.signature(ADVANTAGE_ESTIMATORS.get(name)).parameters.values()
    return {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty}


def estimator_settings(advantage: AdvantageConfig) -> dict[str, Any]:
    """The keyword settings ``advantage`` gives its estimator: ``settings``, and ``eps`` where the estimator takes it."""
    settings = dict(advantage.settings or {})
    if advantage.eps is not None and "eps" in inspect.signature(ADVANTAGE_ESTIMATORS.get(advantage.name)).parameters:
        settings["eps"] = advantage.eps
    return settings


def check_reward_weights(weights: dict[str, float] | None) -> None:
    """Fail now, naming what is wrong, unless ``weights`` names the correctness reward and only known format rewards."""
    names = set(weights or {})
    if CORRECTNESS_REWARD not in names:
        raise ValueError(f"rewards.weights must name {CORRECTNESS_REWARD!r} (the correctness reward, which decides "
                         f"IGPO's hinting), got {sorted(names)}")
    unknown = sorted(names - {CORRECTNESS_REWARD} - set(FORMAT_REWARDS))
    if unknown:
        raise ValueError(f"unknown rewards {unknown} in rewards.weights; valid: "
                         f"{[CORRECTNESS_REWARD, *sorted(FORMAT_REWARDS)]}")


def check_advantage_choice(name: str, settings: dict[str, Any] | None, group_size: int) -> None:
    """Fail now, naming what is wrong, if estimator ``name`` or its settings cannot run in this module:
    an unknown name, an input the dLLM path does not have, or a bad setting (a dry run on one group)."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage {name!r}; valid: {ADVANTAGE_ESTIMATORS.names()}")
    missing = sorted(estimator_inputs(name) - set(PROVIDED_ESTIMATOR_INPUTS))
    if missing:
        raise ValueError(
            f"advantage {name!r} needs the input(s) {missing}, which the dLLM module does not compute "
            f"(it provides {sorted(PROVIDED_ESTIMATOR_INPUTS)}); use another estimator (docs/dllm.md)"
        )
    settings = dict(settings or {})
    clash = sorted(set(settings) & set(PROVIDED_ESTIMATOR_INPUTS))
    if clash:
        raise ValueError(f"advantage.settings {clash} are provided by the module; remove them")
    rewards = torch.arange(group_size, dtype=torch.float32)
    inputs = {"mask": torch.ones(group_size, 1), "reward_baselines": torch.zeros(group_size)}
    settings.update({key: inputs[key] for key in estimator_inputs(name)})
    compute_advantages_with_metrics(name, rewards, torch.zeros(group_size, dtype=torch.long), **settings)


class DiffuGRPO(LegacyHparamsMixin, NonFiniteGuardMixin, MaskPredictorExportHooks, PlainHparamsMixin,
                pl.LightningModule):
    """diffu-GRPO with optional IGPO inpainting (``igpo.enabled``) for masked-diffusion LMs.

    The settings come in groups, one frozen dataclass per concern, nested under ``model.init_args`` in a
    YAML config: the shared ones of :mod:`mmpo.training.config` (``loss``, ``advantage``, ``optim``,
    ``rewards``, as the VLM modules take them) with this module's defaults (IGPO's official run), and the
    dLLM ones of :mod:`mmpo.dllm.config` (``logprob``, ``igpo``). A group in a config sets some fields over
    these defaults. docs/dllm.md has the old flat name of every field.

    Args:
        model_path: SFT-warmed checkpoint to start from (``save_pretrained`` folder).
        warmup_config: if ``model_path`` is missing, run this SFT config first to create it
            (see ``mmpo.dllm.warmup``); None makes a missing ``model_path`` an error.
        save_dir: where the trained policy is written with ``save_pretrained``.
        trust_remote_code: allow the checkpoint's own code (real LLaDA).
        dtype: weight dtype name, e.g. 'bfloat16' for an 8B model (None: as saved).
        sampler: rollout settings (IGPO: L 256, block 32, steps 128, temperature 1.2).
        group_size: rollouts per prompt G (IGPO: 8).
        loss: the policy loss and the KL (:class:`~mmpo.training.config.LossConfig`; default IGPO's:
            name igpo_sequence (the official run's sequence ratio over all L positions, gradient through it;
            ppo = token ratio, gspo = GSPO-token over the loss mask, or any registered core loss: sapo, gpg,
            cispo, gmpo, vespo, ...; docs/dllm.md), clip_low / clip_high 0.2 (passed to every loss with those
            bounds; a loss without them needs 0.2 or null), settings (the loss's own options, e.g. sapo's
            tau_pos), agg token-mean (over the loss mask; seq-mean-token-mean weighs every rollout equally),
            norm_len (seq-mean-token-sum-norm's L; null = gen_length), kl_kind k3, beta 0.01 (d1: 0.04)).
            dual_clip is not supported here; entropy_coef only by :class:`~mmpo.dllm.variants.EPODiffuGRPO`.
        advantage: the estimator (:class:`~mmpo.training.config.AdvantageConfig`; default drgrpo, IGPO's
            r - group mean; eps null = the estimator's default; settings = its other options, e.g.
            reinforce_plus_plus's gamma). Per-token estimators get the completion mask (all ``gen_length``
            positions, as the loss); remax gets one greedy rollout per prompt as its baseline; the optimal
            token baselines need token statistics this module does not compute and are refused, as is
            dynamic_sampling (LSPODiffuGRPO filters groups).
        optim: AdamW, its schedule and the update loop (:class:`~mmpo.training.config.OptimConfig`; IGPO's:
            lr 5e-7 (8B with LoRA), weight_decay 0.1, betas (0.9, 0.99), warmup_steps 50, lr_schedule constant
            (d1's constant_with_warmup; linear = the official IGPO run's TRL default, to trainer.max_steps),
            max_grad_norm 0.2, mu 4 = optimizer steps per batch of rollouts (d1: 12)). Every inner update is one
            optimizer step on the whole batch, so minibatch_size / micro_batch_size must stay null.
        rewards: the reward terms (:class:`~mmpo.training.config.RewardConfig`): weights maps ``correct``
            (required: the correctness reward, which alone decides hinting) and optionally a format reward,
            ``xmlcount`` (IGPO's, for <reasoning>/<answer> prompts) or ``derivation`` (the synthetic task's
            layout), to its weight (IGPO: correct 3.0, xmlcount 1.0; default correct 1.0); timeout_s is the
            deadline for scoring one batch in the reward worker process (killed when missed: the batch scores
            0, counted in ``rewards/correct/timeouts``); null scores inline.
        logprob: the log-prob estimator (:class:`~mmpo.dllm.config.DiffusionLogProbConfig`: masking,
            p_mask_prompt, diffusion_steps, min_timestep, chunk_size).
        igpo: IGPO's inpainting (:class:`~mmpo.dllm.config.InpaintingConfig`: enabled (false = the
            diffu-GRPO baseline), max_replacements, entropy_keep).
        hints: hint construction (chunks, eta range, stretch, free tail).
        lora: train a LoRA adapter instead of all weights (IGPO / d1: r 128, alpha 64, dropout
            0.05); the KL reference is then the same network with the adapter disabled, as in
            the official runs, so no second copy of the model is held. None: full fine-tuning
            with a frozen copy of the starting weights as reference.
        seed: rollout RNG seed (step s uses seed * 1_000_003 + s, so resumes reproduce).
        max_consecutive_skips: optimizer steps with a non-finite loss or gradient norm are skipped (weights and
            optimizer state untouched, counted as perf/skipped_steps); this many in a row stop the run with
            NonFiniteTrainingError (mmpo.training.nonfinite).
        overwrite_output: allow exporting into a save_dir that holds another run's export (refused otherwise).
    """

    config_groups: tuple[str, ...] = ("loss", "advantage", "optim", "rewards", "logprob", "igpo")
    """Attributes holding the module's config dataclasses; checkpoints keep them as plain dicts."""

    entropy_in_loss: bool = False
    """Subclasses whose :meth:`extra_loss_terms` differentiate the update-time entropy (EPO's bonus) set True."""

    def __init__(
        self,
        model_path: str = "runs/dllm/sft_tiny/model",
        warmup_config: str | None = "configs/dllm/sft_tiny.yaml",
        save_dir: str = "runs/dllm/rl/model",
        trust_remote_code: bool = False,
        dtype: str | None = None,
        sampler: SamplerConfig | None = None,
        group_size: int = 8,
        loss: LossConfig = DIFFU_GRPO_LOSS,
        advantage: AdvantageConfig = DIFFU_GRPO_ADVANTAGE,
        optim: OptimConfig = DIFFU_GRPO_OPTIM,
        rewards: RewardConfig = DIFFU_GRPO_REWARDS,
        logprob: DiffusionLogProbConfig = DIFFU_GRPO_LOGPROB,
        igpo: InpaintingConfig = DIFFU_GRPO_INPAINTING,
        hints: HintConfig | None = None,
        lora: LoraSettings | None = None,
        seed: int = 0,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
        overwrite_output: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # dicts (checkpoints, Python short forms) are read back over the module's defaults
        self.loss = as_group(loss, DIFFU_GRPO_LOSS)
        self.advantage = as_group(advantage, DIFFU_GRPO_ADVANTAGE)
        self.optim = as_group(optim, DIFFU_GRPO_OPTIM)
        self.rewards = as_group(rewards, DIFFU_GRPO_REWARDS)
        self.logprob = as_group(logprob, DIFFU_GRPO_LOGPROB)
        self.igpo = as_group(igpo, DIFFU_GRPO_INPAINTING)
        # the groups go into hparams (and so into checkpoints) as plain dicts: weights_only loads them
        for name in self.config_groups:
            self.hparams[name] = dataclasses.asdict(getattr(self, name))
        self.automatic_optimization = False
        self.nonfinite = NonFiniteGuard(max_consecutive_skips)
        self.group_size, self.seed = group_size, seed
        self._check_settings()
        # HAPO's loss reads the update-time entropy: computed (detached) on every inner update when it is chosen
        self.loss_reads_entropy = policy_loss_reads_entropy(self.loss.name)
        if not Path(model_path, "config.json").is_file():
            if warmup_config is None:
                raise FileNotFoundError(f"no model at {model_path!r} and no warmup_config to create it")
            from mmpo.dllm.warmup import ensure_warm_model

            ensure_warm_model(model_path, warmup_config)
        self.model, self.tokenizer = load_mask_predictor(
            model_path, trust_remote_code=trust_remote_code, dtype=getattr(torch, dtype) if dtype else None
        )
        self.mask_id = mask_token_id(self.tokenizer, self.model)
        self.use_lora = lora is not None
        if self.use_lora:
            self.model = wrap_with_lora(self.model, as_config(lora, LoraSettings))
        # The KL anchor is the starting model: with LoRA the adapter-disabled network itself; otherwise
        # a frozen copy, kept out of the module tree so checkpoints hold one copy.
        needs_copy = self.loss.beta > 0 and not self.use_lora
        self.__dict__["ref_model"] = copy.deepcopy(self.model).eval().requires_grad_(False) if needs_copy else None
        self.sampler = as_config(sampler, SamplerConfig)
        self.hints = as_config(hints, HintConfig)
        self.save_dir = save_dir
        self.update_engine = UpdateEngine(
            self, max_grad_norm=self.optim.max_grad_norm,
            clip_groups=lambda: [[p for p in self.model.parameters() if p.requires_grad]])
        # how a whole update pass runs: as is, or wrapped by a variant (SFPO's slow-fast update)
        self.update_wrapper: UpdateWrapper = UpdateWrapper()

    def _check_settings(self) -> None:
        """Checks across groups and against what this module implements (each group checks its own fields),
        before the (slow) model load."""
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {self.group_size}")
        loss, optim, advantage = self.loss, self.optim, self.advantage
        check_loss_choice(DEFAULT_RATIO_LEVEL, loss.name, loss.settings, loss.clip_low, loss.clip_high, loss.kl_kind,
                          loss.agg)
        if loss.dual_clip is not None:
            raise ValueError(f"loss.dual_clip is not supported by the dLLM module, got {loss.dual_clip}; "
                             "set the loss's own option in loss.settings")
        if loss.entropy_coef and not self.entropy_in_loss:
            raise ValueError(f"loss.entropy_coef must be 0 here (got {loss.entropy_coef}): the entropy bonus is "
                             "mmpo.dllm.variants.EPODiffuGRPO's")
        if advantage.dynamic_sampling or advantage.dynamic_sampling_retries:
            raise ValueError("advantage.dynamic_sampling is not supported by the dLLM module "
                             "(mmpo.dllm.variants.LSPODiffuGRPO drops zero-variance groups)")
        check_advantage_choice(advantage.name, estimator_settings(advantage), self.group_size)
        for name in ("minibatch_size", "micro_batch_size"):
            if getattr(optim, name) is not None:
                raise ValueError(f"optim.{name} must be null: every inner update of the dLLM module is one "
                                 f"optimizer step on the whole batch, got {getattr(optim, name)}")
        check_reward_weights(self.rewards.weights)

    # ------------------------------------------------------------------ rollouts

    def _generator(self, offset: int = 0) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + self.global_step + offset)

    def _score(self, texts: list[str], answers: list[str]) -> Tensor:
        scores, metrics = correctness_rewards_with_deadline(texts, answers, timeout_s=self.rewards.timeout_s)
        for key, value in metrics.items():  # summed over the step's scoring calls; restarts is a running total
            self._score_metrics[key] = value if key.startswith("perf/") else self._score_metrics.get(key, 0.0) + value
        return torch.tensor(scores, device=self.device) > 0

    def collect(self, rows: list[dict[str, str]]) -> dict[str, Tensor | float]:
        """Steps 1-3: rollouts, correctness, IGPO hinted regeneration and replacement."""
        group = self.group_size
        problems = [r["problem"] for r in rows for _ in range(group)]
        answers = [r["answer"] for r in rows for _ in range(group)]
        group_ids = torch.arange(len(rows), device=self.device).repeat_interleave(group)
        generator = self._generator()
        self._score_metrics: dict[str, float] = {}
        self.model.eval()
        out = rollout(self.model, self.tokenizer, problems, self.sampler, generator=generator)
        correct = self._score(out.texts, answers)
        sampled_correct = correct.clone()
        completions, hint_mask, texts = out.completions.clone(), torch.zeros_like(out.fixed_mask), list(out.texts)
        wrong_groups = all_wrong_groups(correct.cpu(), group_ids.cpu()).tolist()
        num_replaced, hinted_correct_total, hinted_total = 0, 0, 0
        if self.igpo.enabled and wrong_groups:
            hint_tokens, hint_masks, hinted_problems, hinted_answers = [], [], [], []
            for g in wrong_groups:
                trace_ids = self.tokenizer(rows[g]["trace"], add_special_tokens=False)["input_ids"]
                hint_rng = torch.Generator().manual_seed(int(generator.initial_seed()) + g)
                tokens, mask, _ = build_group_hints(trace_ids, group, self.sampler.gen_length, self.hints, hint_rng)
                hint_tokens.append(tokens)
                hint_masks.append(mask)
                hinted_problems += [rows[g]["problem"]] * group
                hinted_answers += [rows[g]["answer"]] * group
            hinted = rollout(
                self.model, self.tokenizer, hinted_problems, self.sampler,
                fixed_tokens=torch.cat(hint_tokens), fixed_mask=torch.cat(hint_masks), generator=generator,
            )
            # Completions do not depend on the prompt's padding width, so a hinted completion can move
            # into its group's original rows even if the hinted sub-batch was padded narrower.
            hinted_correct = self._score(hinted.texts, hinted_answers)
            hinted_correct_total += int(hinted_correct.sum())
            hinted_total += hinted_correct.numel()
            pick = torch.Generator().manual_seed(int(generator.initial_seed()) + 7919)
            for k, g in enumerate(wrong_groups):
                block = slice(k * group, (k + 1) * group)
                for original, hinted_index in choose_replacements(hinted_correct[block].cpu(), self.igpo.max_replacements, pick):
                    dst, src = g * group + original, k * group + hinted_index
                    completions[dst] = hinted.completions[src]
                    hint_mask[dst] = hinted.fixed_mask[src]
                    texts[dst] = hinted.texts[src]
                    correct[dst] = True
                    num_replaced += 1
        final_wrong = all_wrong_groups(correct.cpu(), group_ids.cpu())
        rewards, formats = self._rewards(correct, texts)
        format_metrics = {} if formats is None else {"rewards/format/mean": float(formats.mean())}
        baselines = {}
        if "reward_baselines" in estimator_inputs(self.advantage.name):
            baselines["reward_baselines"] = self.greedy_reward_baselines(rows)
        per_function = {"correct": correct.float(), **({} if formats is None else {"format": formats})}
        return {
            **baselines,
            "samples": {"prompts": problems, "texts": texts, "per_function": per_function},  # for completion_samples
            "prompt_ids": out.prompt_ids,
            "prompt_mask": out.prompt_attention_mask,
            "completions": completions,
            "hint_mask": hint_mask,
            "rewards": rewards,
            "group_ids": group_ids,
            "metrics": {
                "rewards/correct/mean": float(sampled_correct.float().mean()),
                "rewards/total/mean": float(rewards.mean()),
                "igpo/frac_all_wrong_sampled": len(wrong_groups) / len(rows),
                "igpo/frac_all_wrong": final_wrong.numel() / len(rows),
                "igpo/num_replaced": float(num_replaced),
                "igpo/hinted_accuracy": hinted_correct_total / hinted_total if hinted_total else 0.0,
                "igpo/hint_token_frac": float(hint_mask.float().mean()),
                **format_metrics,
                **self._score_metrics,
            },
        }

    def _rewards(self, correct: Tensor, texts: list[str]) -> tuple[Tensor, Tensor | None]:
        """(correct x weights[correct] + the weighted format rewards of the texts, the weighted format rewards
        summed, or None without any)."""
        weights = dict(self.rewards.weights)
        rewards = correct.float() * weights.pop(CORRECTNESS_REWARD)
        if not weights:
            return rewards, None
        formats = sum(torch.tensor(format_rewards(texts, name), device=self.device) * weight
                      for name, weight in weights.items())
        return rewards + formats, formats

    def greedy_reward_baselines(self, rows: list[dict[str, str]]) -> Tensor:
        """(N,) ReMax baseline: the reward of one greedy (temperature 0) rollout of each prompt, repeated over
        its group. Scored like the sampled rollouts (correctness + format reward; no hints); its own
        generator, so the sampled rollouts do not change with ``advantage``."""
        greedy = rollout(self.model, self.tokenizer, [r["problem"] for r in rows], self.export_sampler(),
                         generator=self._generator(offset=15485863))
        rewards, _ = self._rewards(self._score(greedy.texts, [r["answer"] for r in rows]), greedy.texts)
        return rewards.repeat_interleave(self.group_size)

    def compute_advantages(self, batch: dict) -> tuple[Tensor, dict[str, float]]:
        """(N,) or (N, L) advantages of the batch's rewards by the ``advantage`` estimator (core).

        Per-token estimators get the completion mask: all ``gen_length`` positions (the loss's tokens
        before the hint-entropy filter; d1 / IGPO score every position, EOS padding included)."""
        name = self.advantage.name
        inputs = estimator_inputs(name)
        settings = estimator_settings(self.advantage)
        if "mask" in inputs:
            settings["mask"] = torch.ones(batch["completions"].shape, dtype=batch["rewards"].dtype,
                                          device=batch["rewards"].device)
        if "reward_baselines" in inputs:
            settings["reward_baselines"] = batch["reward_baselines"]
        return compute_advantages_with_metrics(name, batch["rewards"], batch["group_ids"], **settings)

    # ------------------------------------------------------------------ training

    def _log_probs(self, model: torch.nn.Module, batch: dict, key: tuple[int, float], with_entropy: bool = False,
                   entropy_grad: bool = False):
        seed, ratio = key
        return completion_log_probs(
            model, batch["prompt_ids"], batch["prompt_mask"], batch["completions"], mask_token_id=self.mask_id,
            p_mask_prompt=self.logprob.p_mask_prompt, completion_mask_ratio=ratio, seed=seed,
            with_entropy=with_entropy, entropy_grad=entropy_grad, chunk_size=self.logprob.chunk_size,
        )

    def _reference_log_probs(self, batch: dict, keys: list[tuple[int, float]]) -> dict[tuple[int, float], Tensor]:
        if self.use_lora:
            with self.model.disable_adapter():
                return {key: self._log_probs(self.model, batch, key)[0] for key in keys}
        return {key: self._log_probs(self.ref_model, batch, key)[0] for key in keys}

    def _loss_mask(self, batch: dict, old_entropy: Tensor, key: tuple[int, float]) -> Tensor:
        """Tokens in the loss for one scoring key: IGPO's hint-entropy filter, and with structured
        masking only the positions that key masked (the others were visible, not predicted)."""
        loss_mask = torch.ones_like(batch["hint_mask"])
        if batch["hint_mask"].any():
            loss_mask = hint_entropy_filter(batch["hint_mask"], old_entropy, self.igpo.entropy_keep)
        seed, ratio = key
        if ratio < 1.0:
            loss_mask = loss_mask & perturb_for_scoring(
                batch["prompt_ids"], batch["prompt_mask"], batch["completions"], mask_token_id=self.mask_id,
                p_mask_prompt=self.logprob.p_mask_prompt, completion_mask_ratio=ratio, seed=seed,
            )[2]
        return loss_mask

    def scoring_keys(self) -> list[tuple[int, float]]:
        """(mask seed, completion mask ratio) of each inner update of the current batch.

        Full masking: d1 draws one prompt-mask seed per inner step; with ``p_mask_prompt = 0`` every
        step sees the same input. Structured: IGPO's timesteps t_n, ratio t_n / T, one seed per step.
        Seeds derive from ``global_step`` so a resumed run draws the same masks.
        """
        mu, logprob = self.optim.mu, self.logprob
        if logprob.masking == "full":
            return [(self.global_step * 1000 + i if logprob.p_mask_prompt > 0 else 0, 1.0) for i in range(mu)]
        steps = structured_timesteps(mu, logprob.diffusion_steps, logprob.min_timestep, self._generator(offset=104729))
        return [(self.global_step * 1000 + i, t / logprob.diffusion_steps) for i, t in enumerate(steps)]

    def training_step(self, rows: list[dict[str, str]], batch_idx: int) -> Tensor:
        state = StepState(step=self.global_step, rows=list(rows))
        self.begin_step(state)  # hook: before the rollout
        batch = self.collect(state.rows)
        state.rewards = batch["rewards"]
        advantages, adv_metrics = self.compute_advantages(batch)
        state.advantages = advantages
        samples = batch["samples"]
        self.completion_samples = CompletionSamples.build(  # read by mmpo.training.completions.LogCompletions
            state.step, samples["prompts"], samples["texts"], batch["rewards"], samples["per_function"], advantages)
        keys = self.scoring_keys()
        unique_keys = sorted(set(keys))
        with torch.no_grad():
            self.model.eval()
            old = {key: self._log_probs(self.model, batch, key, with_entropy=True) for key in unique_keys}
            ref = self._reference_log_probs(batch, unique_keys) if self.loss.beta > 0 else {}
        loss_masks = {key: self._loss_mask(batch, old[key][1], key) for key in unique_keys}
        keep, filter_metrics = self.filter_groups(batch)
        if keep is not None:  # dropped groups leave the loss (masked, so the batch keeps its size)
            loss_masks = {key: mask & keep.to(mask.device).unsqueeze(-1) for key, mask in loss_masks.items()}
        metrics_sum, loss = self.update_policy(batch, keys, old, ref, advantages, loss_masks, state=state)
        self.end_step(state)  # hook: algorithm state after the update (EPO's entropy history); adds metrics
        metrics_sum.update(filter_metrics)
        metrics_sum.update(state.metrics)
        optimizer = self.optimizers()
        batch_size = len(rows)
        metrics_sum["perf/skipped_steps"] = float(self.nonfinite.skipped_steps)
        metrics_sum["lr"] = optimizer.param_groups[0]["lr"]  # for the next step, as the VLM modules log it
        logged = {**batch["metrics"], **adv_metrics, **metrics_sum}
        shown = {"rewards/total/mean", "igpo/frac_all_wrong"}  # the progress bar's
        self.log_dict({k: v for k, v in logged.items() if k in shown}, prog_bar=True, batch_size=batch_size)
        self.log_dict({k: v for k, v in logged.items() if k not in shown}, batch_size=batch_size)
        return loss.detach()

    def begin_step(self, state: StepState) -> None:
        """Hook before the rollout (may replace ``state.rows``, add ``state.metrics``). Default: nothing."""

    def end_step(self, state: StepState) -> None:
        """Hook after the update: algorithm state from ``state`` (what the loss hooks collected on it) and
        ``state.metrics``. Default: nothing."""

    def filter_groups(self, batch: dict) -> tuple[Tensor | None, dict[str, float]]:
        """(N,) bool keep mask of the samples whose groups stay in the loss (None = all) and metrics
        (hook: LSPO's length bands, ``mmpo.dllm.variants``). Default: no filter."""
        return None, {}

    def update_policy(
        self, batch: dict, keys: list[tuple[int, float]], old: dict, ref: dict, advantages: Tensor,
        loss_masks: dict[tuple[int, float], Tensor], state: StepState | None = None,
    ) -> tuple[dict[str, float], Tensor]:
        """One optimizer step per scoring key on the clipped loss + beta KL, through the update engine
        (``mmpo.training.update``) and the module's update wrapper (SFPO's slow-fast pass).

        ``old`` / ``ref`` map a key to its (log-probs, entropy) / log-probs without grad. Returns the
        metrics averaged over the steps and the last step's loss (each step's: :meth:`inner_update_loss`)."""
        self.model.train()
        last: dict[str, Tensor] = {}

        def step(_epoch: int, index: Tensor) -> dict[str, float]:
            key = keys[int(index)]
            result = self.update_engine.optimizer_step(
                [key], lambda k: MicroLoss(*self.inner_update_loss(batch, k, old[k][0], ref.get(k), advantages,
                                                                   loss_masks[k], state)))
            last["loss"] = result.last_loss
            return result.metrics

        def plain_pass() -> list[dict[str, float]]:  # the scoring keys in order, one optimizer step each
            return self.update_engine.run_pass(UpdateSchedule(len(keys), 1, shuffle=False), step)

        def old_policy_entropy(_stats: list[dict[str, float]]) -> float:
            """Token-mean entropy of theta_0 over each key's loss mask, averaged over the keys (computed
            anyway with the old log-probs; the default loss computes no update-time entropy)."""
            entropies = [float((old[key][1] * mask).sum() / mask.sum().clamp_min(1)) for key, mask in loss_masks.items()]
            return sum(entropies) / len(entropies)

        stats = self.update_wrapper.wrap(plain_pass, self.model.parameters, PassContext(mean_entropy=old_policy_entropy))
        metrics_mean: dict[str, float] = {}
        for metrics in stats:
            for name, value in metrics.items():
                metrics_mean[name] = metrics_mean.get(name, 0.0) + float(value) / len(stats)
        return metrics_mean, last["loss"]

    def inner_update_loss(
        self, batch: dict, key: tuple[int, float], old_log_probs: Tensor, ref_log_probs: Tensor | None,
        advantages: Tensor, loss_mask: Tensor, state: StepState | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """The loss of one inner update on scoring ``key``: ``igpo_loss`` (policy + beta KL) plus the named parts
        of :meth:`extra_loss_terms`, and the metrics of both.

        The update-time entropy (the mask predictor's at every scored completion position) is computed when the
        policy loss reads it (``hapo``, detached) or a subclass puts it in the loss (``entropy_in_loss``, with grad).
        """
        loss_config = self.loss
        with_entropy = self.loss_reads_entropy or self.entropy_in_loss
        log_probs, entropy = self._log_probs(self.model, batch, key, with_entropy=with_entropy,
                                             entropy_grad=self.entropy_in_loss)
        parts, core_metrics = igpo_loss_parts(
            log_probs, old_log_probs, ref_log_probs, advantages, loss_mask, clip_low=loss_config.clip_low,
            clip_high=loss_config.clip_high, beta=loss_config.beta, agg=loss_config.agg, loss=loss_config.name,
            kl_kind=loss_config.kl_kind, loss_settings=loss_config.settings, entropy=entropy,
            norm_len=loss_config.norm_len,
        )
        extra, extra_metrics = self.extra_loss_terms(entropy, loss_mask, state)
        loss, named = total_loss(parts, extra)  # a part of the same name as the policy loss's is refused
        # one scoring key is one optimizer step of one micro-batch: the ratio's extremes are kept
        metrics = micro_batch_metrics(named, loss, core_metrics, extra=extra, single_micro_batch=True)
        metrics.update({key: float(value) for key, value in extra_metrics.items()})
        return loss, metrics

    def extra_loss_terms(self, entropy: Tensor | None, loss_mask: Tensor,
                         state: StepState | None = None) -> tuple[LossParts, dict[str, Any]]:
        """Named loss parts added to the inner update's loss, and metrics (hook: EPO's entropy terms).

        ``entropy``: ``(N, L)`` update-time entropy (with grad when ``entropy_in_loss``; None when neither the
        loss nor the subclass asked for it); ``loss_mask``: that update's ``(N, L)`` loss mask; ``state``: this
        step's :class:`~mmpo.training.step_state.StepState` (``collect`` what ``end_step`` needs; None outside a
        training step). Default: none."""
        return LossParts(), {}

    def on_fit_start(self) -> None:
        self.model.train()  # from_pretrained returns eval mode; rollouts switch to eval themselves
        if self.ref_model is not None:
            self.ref_model.to(self.device)

    # ------------------------------------------------------------------ evaluation and export

    def export_sampler(self) -> SamplerConfig:
        """The exported policy decodes greedily by default."""
        return replace(self.sampler, temperature=0.0)

    def configure_optimizers(self):
        optim = self.optim
        return make_optimizer(self.model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay, betas=optim.betas,
                              warmup_steps=optim.warmup_steps, schedule=optim.lr_schedule,
                              total_steps=max_steps_or_none(self))
