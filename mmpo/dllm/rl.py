"""diffu-GRPO and IGPO for masked-diffusion LMs as one Lightning module.

One training step (IGPO, arXiv 2509.10396, Algorithm 1 / ``facebookresearch/igpo:trainer_igpo.py``;
with ``igpo: false`` it is the diffu-GRPO baseline of d1, arXiv 2504.12216, as in IGPO's
``trainer_baseline.py``):

1. roll out G completions per prompt with the LLaDA block sampler (temperature tau);
2. score them with the correctness reward;
3. IGPO only: every group whose rollouts are all wrong is regenerated with hints from its
   reference trace (``mmpo.dllm.hints``; hint positions fixed during denoising), and up to
   ``max_replacements`` correct hinted rollouts replace original ones;
4. advantages r - mean over the (mixed) group (core ``drgrpo``; ``advantage`` picks any core estimator
   whose inputs exist here: ``remax`` adds one greedy rollout per prompt for its baseline);
5. old and reference log-probs (+ old entropies) by the one-pass estimator
   (completion fully masked; prompt masked with ``p_mask_prompt``, one seed per inner step),
   or with ``masking: structured`` by IGPO's structured estimator (inner step n masks each
   completion token with probability t_n / T; only masked positions enter the loss);
6. IGPO only: keep only the top ``entropy_keep`` fraction of hint tokens by old entropy;
7. ``inner_updates`` (mu) optimizer steps on the clipped loss + beta * k3 KL (``loss`` / ``kl_kind``
   select any core policy loss / KL estimator).

Metrics (the shared vocabulary of docs/core.md): ``rewards/correct/mean`` (sampled rollouts),
``rewards/total/mean`` (after replacement, format reward included), ``rewards/format/mean`` (with a format reward),
``igpo/frac_all_wrong_sampled`` (groups all wrong before hints),
``igpo/frac_all_wrong`` (after replacement: groups that give no learning signal),
``igpo/num_replaced``, ``igpo/hinted_accuracy``, ``rewards/correct/errors``, ``/timeouts`` and
``/verify_errors`` (scoring calls that failed or missed ``reward_timeout_s``; answers math-verify
raised on), ``perf/reward_worker_restarts``, ``losses/policy``, ``losses/kl``,
``policy/*`` from the core, ``perf/skipped_steps``, ``lr``, ``val/accuracy`` (greedy, held out).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from mmpo.dllm.checkpoint_hparams import PlainHparamsMixin, as_config
from mmpo.dllm.export_hooks import MaskPredictorExportHooks
from mmpo.dllm.hints import HintConfig, build_group_hints
from mmpo.dllm.igpo import all_wrong_groups, check_loss_choice, choose_replacements, hint_entropy_filter, igpo_loss
from mmpo.dllm.logprobs import completion_log_probs, perturb_for_scoring, structured_timesteps
from mmpo.training.lora import LoraSettings, wrap_with_lora
from mmpo.dllm.modeling import load_mask_predictor, mask_token_id
from mmpo.dllm.rewards import FORMAT_REWARDS, correctness_rewards_with_deadline, format_rewards
from mmpo.dllm.rollout import rollout
from mmpo.dllm.sampler import SamplerConfig
from mmpo.core import ADVANTAGE_ESTIMATORS, LossParts, compute_advantages_with_metrics, policy_loss_reads_entropy
from mmpo.core.aggregate import AggregationMode
from mmpo.training.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS, NonFiniteGuard, NonFiniteGuardMixin
from mmpo.training.step_state import StepState
from mmpo.training.completions import CompletionSamples
from mmpo.training.update import MicroLoss, PassContext, UpdateEngine, UpdateSchedule, UpdateWrapper
from mmpo.training.lr_schedule import SCHEDULES
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
        raise ValueError(f"advantage_settings {clash} are provided by the module; remove them")
    rewards = torch.arange(group_size, dtype=torch.float32)
    inputs = {"mask": torch.ones(group_size, 1), "reward_baselines": torch.zeros(group_size)}
    settings.update({key: inputs[key] for key in estimator_inputs(name)})
    compute_advantages_with_metrics(name, rewards, torch.zeros(group_size, dtype=torch.long), **settings)


class DiffuGRPO(NonFiniteGuardMixin, MaskPredictorExportHooks, PlainHparamsMixin, pl.LightningModule):
    """diffu-GRPO with optional IGPO inpainting (``igpo: true``) for masked-diffusion LMs.

    Args:
        model_path: SFT-warmed checkpoint to start from (``save_pretrained`` folder).
        warmup_config: if ``model_path`` is missing, run this SFT config first to create it
            (see ``mmpo.dllm.warmup``); None makes a missing ``model_path`` an error.
        save_dir: where the trained policy is written with ``save_pretrained``.
        trust_remote_code: allow the checkpoint's own code (real LLaDA).
        dtype: weight dtype name, e.g. 'bfloat16' for an 8B model (None: as saved).
        sampler: rollout settings (IGPO: L 256, block 32, steps 128, temperature 1.2).
        group_size: rollouts per prompt G (IGPO: 8).
        inner_updates: optimizer steps per batch of rollouts, mu (IGPO: 4; d1: 12).
        lr: AdamW learning rate (IGPO: 5e-7 on 8B with LoRA).
        weight_decay: AdamW weight decay (IGPO / d1: 0.1).
        betas: AdamW betas (IGPO / d1: 0.9, 0.99).
        warmup_steps: linear learning-rate warm-up, in optimizer steps (IGPO: 50).
        lr_schedule: after warm-up: 'constant' (d1's constant_with_warmup; default), 'linear' (decay to 0 at
            trainer.max_steps; the official IGPO run's TRL default) or 'cosine'. Stepped once per optimizer
            step (inner update), like trainer.max_steps.
        max_grad_norm: gradient clipping (IGPO / d1: 0.2).
        beta: KL coefficient against the starting model (IGPO: 0.01; d1: 0.04).
        kl_kind: KL estimator (mmpo.core ``kl_penalty``: k1, k2, k3, abs, verl's kl, mse, low_var_kl, or a
            straight-through ``+`` name); IGPO / d1: k3.
        clip_low: PPO lower clip (IGPO: 0.2); passed to every loss with a ``clip_low`` bound.
        clip_high: PPO upper clip (IGPO: 0.2); passed to every loss with a ``clip_high`` bound.
        ratio_level: 'sequence' (IGPO's official run: sequence ratio over all L positions,
            gradient through it), 'sequence_masked' (GSPO-token over the loss mask) or 'token'.
        loss: None (the loss ``ratio_level`` selects: ppo / igpo_sequence / gspo) or any registered core policy
            loss (sapo, gpg, cispo, gmpo, vespo, ...; docs/dllm.md). With ``loss`` set, ``ratio_level`` must be
            'sequence' (its default: left to ``loss``) or select the same loss; a loss without clip bounds
            (sapo, gpg, kl_cov, vespo) needs clip_low / clip_high at their default 0.2 (they would be ignored).
        loss_settings: further keyword settings of the policy loss (e.g. sapo's tau_pos / tau_neg).
        advantage: core advantage estimator (default 'drgrpo', IGPO's r - group mean). Per-token estimators get
            the completion mask (all ``gen_length`` positions, as the loss); 'remax' gets one greedy rollout
            per prompt as its baseline; the optimal token baselines need token statistics this module does not
            compute and are refused.
        advantage_settings: further keyword settings of the estimator (e.g. grpo's eps, reinforce_plus_plus's gamma).
        loss_agg: aggregation of the per-token loss and KL (IGPO / d1: 'token-mean' over the
            loss mask; 'seq-mean-token-mean' weighs every rollout equally).
        p_mask_prompt: prompt masking probability of the estimator (IGPO: 0; d1: 0.15).
        masking: 'full' (the one-pass estimator: every completion token masked; IGPO's official
            run, ``d1_masking: true``) or 'structured' (IGPO's ``d1_masking: false`` path: inner
            step n masks completion tokens with probability t_n / T and scores only those).
        diffusion_steps: T of the structured schedule (IGPO: 128).
        min_timestep: smallest t_0 of the structured schedule (IGPO: 30).
        correct_reward: reward of a correct answer (IGPO: 3.0; only the scale of A changes).
        format_reward: added format reward, 'xmlcount' (IGPO's, for <reasoning>/<answer> prompts)
            or 'derivation' (the synthetic task's layout); None for correctness only. It never
            triggers hinting: all-wrong means no correct answer.
        reward_timeout_s: deadline in seconds for scoring one batch of rollouts; scoring runs in
            the reward worker process, killed when it is missed (the batch scores 0, counted in
            ``rewards/correct/timeouts``). None scores inline without one.
        igpo: regenerate all-wrong groups with hints (False = diffu-GRPO baseline).
        hints: hint construction (chunks, eta range, stretch, free tail).
        max_replacements: at most this many hinted rollouts enter a group (IGPO: 4 of 8).
        entropy_keep: fraction of hint tokens kept in the loss, by entropy (IGPO: 0.2).
        lora: train a LoRA adapter instead of all weights (IGPO / d1: r 128, alpha 64, dropout
            0.05); the KL reference is then the same network with the adapter disabled, as in
            the official runs, so no second copy of the model is held. None: full fine-tuning
            with a frozen copy of the starting weights as reference.
        logprob_chunk_size: rows per chunk of the log-softmax.
        seed: rollout RNG seed (step s uses seed * 1_000_003 + s, so resumes reproduce).
        max_consecutive_skips: optimizer steps with a non-finite loss or gradient norm are skipped (weights and
            optimizer state untouched, counted as perf/skipped_steps); this many in a row stop the run with
            NonFiniteTrainingError (mmpo.training.nonfinite).
        overwrite_output: allow exporting into a save_dir that holds another run's export (refused otherwise).
    """

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
        inner_updates: int = 4,
        lr: float = 5e-7,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.99),
        warmup_steps: int = 50,
        lr_schedule: str = "constant",
        max_grad_norm: float = 0.2,
        beta: float = 0.01,
        kl_kind: str = "k3",
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        ratio_level: str = "sequence",
        loss: str | None = None,
        loss_settings: dict[str, Any] | None = None,
        advantage: str = "drgrpo",
        advantage_settings: dict[str, Any] | None = None,
        loss_agg: str = "token-mean",
        p_mask_prompt: float = 0.0,
        masking: str = "full",
        diffusion_steps: int = 128,
        min_timestep: int = 30,
        correct_reward: float = 1.0,
        format_reward: str | None = None,
        reward_timeout_s: float | None = 10.0,
        igpo: bool = True,
        hints: HintConfig | None = None,
        max_replacements: int = 4,
        entropy_keep: float = 0.2,
        lora: LoraSettings | None = None,
        logprob_chunk_size: int = 1024,
        seed: int = 0,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
        overwrite_output: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.nonfinite = NonFiniteGuard(max_consecutive_skips)
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
        if inner_updates < 1:
            raise ValueError(f"inner_updates must be >= 1, got {inner_updates}")
        if loss_agg not in {mode.value for mode in AggregationMode}:
            raise ValueError(f"unknown loss_agg {loss_agg!r}; valid: {[mode.value for mode in AggregationMode]}")
        loss_name = check_loss_choice(ratio_level, loss, loss_settings, clip_low, clip_high, kl_kind, loss_agg)
        # HAPO's loss reads the update-time entropy: computed (detached) on every inner update when it is chosen
        self.loss_reads_entropy = policy_loss_reads_entropy(loss_name)
        check_advantage_choice(advantage, advantage_settings, group_size)
        if format_reward is not None and format_reward not in FORMAT_REWARDS:
            raise ValueError(f"unknown format_reward {format_reward!r}; valid: {sorted(FORMAT_REWARDS)} or None")
        if reward_timeout_s is not None and reward_timeout_s <= 0:
            raise ValueError(f"reward_timeout_s must be > 0 or None, got {reward_timeout_s}")
        if lr_schedule not in SCHEDULES:
            raise ValueError(f"unknown lr_schedule {lr_schedule!r}; valid: {list(SCHEDULES)}")
        if masking not in ("full", "structured"):
            raise ValueError(f"masking must be 'full' or 'structured', got {masking!r}")
        if masking == "structured" and not 1 <= min_timestep <= diffusion_steps - 2:
            raise ValueError(f"need 1 <= min_timestep <= diffusion_steps - 2, got {min_timestep} and {diffusion_steps}")
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
        needs_copy = beta > 0 and not self.use_lora
        self.__dict__["ref_model"] = copy.deepcopy(self.model).eval().requires_grad_(False) if needs_copy else None
        self.sampler = as_config(sampler, SamplerConfig)
        self.hints = as_config(hints, HintConfig)
        self.save_dir = save_dir
        self.update_engine = UpdateEngine(
            self, max_grad_norm=max_grad_norm,
            clip_groups=lambda: [[p for p in self.model.parameters() if p.requires_grad]])
        # how a whole update pass runs: as is, or wrapped by a variant (SFPO's slow-fast update)
        self.update_wrapper: UpdateWrapper = UpdateWrapper()
        self.settings = dict(
            group_size=group_size, inner_updates=inner_updates, beta=beta, clip_low=clip_low, clip_high=clip_high,
            ratio_level=ratio_level, loss=loss, loss_settings=dict(loss_settings or {}), kl_kind=kl_kind,
            advantage=advantage, advantage_settings=dict(advantage_settings or {}), loss_agg=loss_agg,
            p_mask_prompt=p_mask_prompt, masking=masking,
            diffusion_steps=diffusion_steps, min_timestep=min_timestep, correct_reward=correct_reward,
            format_reward=format_reward, reward_timeout_s=reward_timeout_s, igpo=igpo,
            max_replacements=max_replacements, entropy_keep=entropy_keep, chunk=logprob_chunk_size, seed=seed,
        )

    # ------------------------------------------------------------------ rollouts

    def _generator(self, offset: int = 0) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.settings["seed"] * 1_000_003 + self.global_step + offset)

    def _score(self, texts: list[str], answers: list[str]) -> Tensor:
        scores, metrics = correctness_rewards_with_deadline(texts, answers, timeout_s=self.settings["reward_timeout_s"])
        for key, value in metrics.items():  # summed over the step's scoring calls; restarts is a running total
            self._score_metrics[key] = value if key.startswith("perf/") else self._score_metrics.get(key, 0.0) + value
        return torch.tensor(scores, device=self.device) > 0

    def collect(self, rows: list[dict[str, str]]) -> dict[str, Tensor | float]:
        """Steps 1-3: rollouts, correctness, IGPO hinted regeneration and replacement."""
        s = self.settings
        group = s["group_size"]
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
        if s["igpo"] and wrong_groups:
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
                for original, hinted_index in choose_replacements(hinted_correct[block].cpu(), s["max_replacements"], pick):
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
        if "reward_baselines" in estimator_inputs(s["advantage"]):
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
        """(correct x correct_reward [+ format reward of the texts], format rewards or None)."""
        s = self.settings
        rewards = correct.float() * s["correct_reward"]
        if s["format_reward"] is None:
            return rewards, None
        formats = torch.tensor(format_rewards(texts, s["format_reward"]), device=self.device)
        return rewards + formats, formats

    def greedy_reward_baselines(self, rows: list[dict[str, str]]) -> Tensor:
        """(N,) ReMax baseline: the reward of one greedy (temperature 0) rollout of each prompt, repeated over
        its group. Scored like the sampled rollouts (correctness + format reward; no hints); its own
        generator, so the sampled rollouts do not change with ``advantage``."""
        greedy = rollout(self.model, self.tokenizer, [r["problem"] for r in rows], self.export_sampler(),
                         generator=self._generator(offset=15485863))
        rewards, _ = self._rewards(self._score(greedy.texts, [r["answer"] for r in rows]), greedy.texts)
        return rewards.repeat_interleave(self.settings["group_size"])

    def compute_advantages(self, batch: dict) -> tuple[Tensor, dict[str, float]]:
        """(N,) or (N, L) advantages of the batch's rewards by the ``advantage`` estimator (core).

        Per-token estimators get the completion mask: all ``gen_length`` positions (the loss's tokens
        before the hint-entropy filter; d1 / IGPO score every position, EOS padding included)."""
        s = self.settings
        inputs = estimator_inputs(s["advantage"])
        settings = dict(s["advantage_settings"])
        if "mask" in inputs:
            settings["mask"] = torch.ones(batch["completions"].shape, dtype=batch["rewards"].dtype,
                                          device=batch["rewards"].device)
        if "reward_baselines" in inputs:
            settings["reward_baselines"] = batch["reward_baselines"]
        return compute_advantages_with_metrics(s["advantage"], batch["rewards"], batch["group_ids"], **settings)

    # ------------------------------------------------------------------ training

    def _log_probs(self, model: torch.nn.Module, batch: dict, key: tuple[int, float], with_entropy: bool = False,
                   entropy_grad: bool = False):
        seed, ratio = key
        return completion_log_probs(
            model, batch["prompt_ids"], batch["prompt_mask"], batch["completions"], mask_token_id=self.mask_id,
            p_mask_prompt=self.settings["p_mask_prompt"], completion_mask_ratio=ratio, seed=seed,
            with_entropy=with_entropy, entropy_grad=entropy_grad, chunk_size=self.settings["chunk"],
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
            loss_mask = hint_entropy_filter(batch["hint_mask"], old_entropy, self.settings["entropy_keep"])
        seed, ratio = key
        if ratio < 1.0:
            loss_mask = loss_mask & perturb_for_scoring(
                batch["prompt_ids"], batch["prompt_mask"], batch["completions"], mask_token_id=self.mask_id,
                p_mask_prompt=self.settings["p_mask_prompt"], completion_mask_ratio=ratio, seed=seed,
            )[2]
        return loss_mask

    def scoring_keys(self) -> list[tuple[int, float]]:
        """(mask seed, completion mask ratio) of each inner update of the current batch.

        Full masking: d1 draws one prompt-mask seed per inner step; with ``p_mask_prompt = 0`` every
        step sees the same input. Structured: IGPO's timesteps t_n, ratio t_n / T, one seed per step.
        Seeds derive from ``global_step`` so a resumed run draws the same masks.
        """
        s = self.settings
        mu = s["inner_updates"]
        if s["masking"] == "full":
            return [(self.global_step * 1000 + i if s["p_mask_prompt"] > 0 else 0, 1.0) for i in range(mu)]
        steps = structured_timesteps(mu, s["diffusion_steps"], s["min_timestep"], self._generator(offset=104729))
        return [(self.global_step * 1000 + i, t / s["diffusion_steps"]) for i, t in enumerate(steps)]

    def training_step(self, rows: list[dict[str, str]], batch_idx: int) -> Tensor:
        s = self.settings
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
            ref = self._reference_log_probs(batch, unique_keys) if s["beta"] > 0 else {}
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
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one inner update on scoring ``key``: ``igpo_loss`` (policy + beta KL) plus the named parts
        of :meth:`extra_loss_terms`, and the metrics of both.

        The update-time entropy (the mask predictor's at every scored completion position) is computed when the
        policy loss reads it (``hapo``, detached) or a subclass puts it in the loss (``entropy_in_loss``, with grad).
        """
        s = self.settings
        with_entropy = self.loss_reads_entropy or self.entropy_in_loss
        log_probs, entropy = self._log_probs(self.model, batch, key, with_entropy=with_entropy,
                                             entropy_grad=self.entropy_in_loss)
        loss, metrics = igpo_loss(
            log_probs, old_log_probs, ref_log_probs, advantages, loss_mask, ratio_level=s["ratio_level"],
            clip_low=s["clip_low"], clip_high=s["clip_high"], beta=s["beta"], agg=s["loss_agg"],
            loss=s["loss"], kl_kind=s["kl_kind"], loss_settings=s["loss_settings"], entropy=entropy,
        )
        extra, extra_metrics = self.extra_loss_terms(entropy, loss_mask, state)
        if len(extra):
            clash = sorted(set(extra.metrics()) & set(metrics))
            if clash:
                raise ValueError(f"extra loss parts {clash} clash with the policy loss's parts")
            loss = loss + extra.total()
            metrics = {**metrics, **extra.metrics(), **extra_metrics}
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
        h = self.hparams
        return make_optimizer(self.model.parameters(), lr=h.lr, weight_decay=h.weight_decay, betas=tuple(h.betas),
                              warmup_steps=h.warmup_steps, schedule=h.lr_schedule, total_steps=max_steps_or_none(self))
