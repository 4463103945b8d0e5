"""Supervised fine-tuning (SFT warm-up) of a VLM on rendered reference solutions.

Teacher forcing on ``render_solution(row)`` + ``<|im_end|>``; the loss is the token-mean
negative log-likelihood of the completion tokens only (prompt and image tokens carry
no loss). Log-probs go through the same chunked path as GRPO (``completion_log_probs``),
so the full (B, T, V) logits tensor is never built. The result is saved in HF format
(``save_pretrained`` of model and processor) for the next stage (GRPO, ``mmpo eval``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import lightning as L
import torch

from mmpo.algos.config import VLMCheckpointHooks, greedy_validation_metrics, make_optimizer, require
from mmpo.training.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS, NonFiniteGuard, NonFiniteGuardMixin
from mmpo.vlm.factory import load_vlm
from mmpo.vlm.logprobs import DEFAULT_LOGPROB_CHUNK, completion_log_probs
from mmpo.vlm.processing import encode_completions, encode_prompts
from mmpo.vlm.rollout import HFGenerateEngine

STYLES = ("think-answer", "steps")


class SFTModule(NonFiniteGuardMixin, VLMCheckpointHooks, L.LightningModule):
    """Teacher-forced SFT on reference solutions (loss on completion tokens only).

    Args:
        model_path: saved HF model directory (e.g. ``build_tiny_vlm`` output or a real checkpoint).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear learning-rate warm-up, in optimizer steps.
        lr_schedule: after warm-up: constant, linear or cosine decay to trainer.max_steps.
        style: solution style taught: think-answer (default) or steps (StepGRPO).
        max_completion_length: truncate target completions to this many tokens (None = no limit).
        max_prompt_length: refuse prompts longer than this (never truncated); None = no limit.
        logprob_chunk_size: token positions per chunk of the vocabulary projection.
        val_max_new_tokens: completion length for greedy validation.
        min_pixels: image processor min pixels override (None = saved processor's).
        max_pixels: image processor max pixels override (None = saved processor's).
        dtype: model weights dtype (float32 on CPU; bfloat16 on GPU).
        gradient_checkpointing: recompute activations in backward to save memory.
        system_prompt: "default" = the system prompt of ``style``; empty = none.
        output_dir: where HF weights (model + processor) are written; None = not saved.
        save_hf_on_checkpoint: also write HF weights to output_dir whenever a Lightning checkpoint is saved.
        overwrite_output: allow exporting into an output_dir that holds another run's export (refused otherwise).
        reward_timeout_s: per reward-function call deadline during validation.
        max_consecutive_skips: optimizer steps with a non-finite loss or gradient norm are skipped (weights and
            optimizer state untouched, counted as perf/skipped_steps); this many in a row stop the run with
            NonFiniteTrainingError (mmpo.training.nonfinite).
    """

    def __init__(
        self,
        model_path: str,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lr_schedule: str = "constant",
        style: str = "think-answer",
        max_completion_length: int | None = None,
        max_prompt_length: int | None = None,
        logprob_chunk_size: int = DEFAULT_LOGPROB_CHUNK,
        val_max_new_tokens: int = 64,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        dtype: str = "float32",
        gradient_checkpointing: bool = False,
        system_prompt: str | None = "default",
        output_dir: str | None = None,
        save_hf_on_checkpoint: bool = True,
        overwrite_output: bool = False,
        reward_timeout_s: float = 10.0,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.nonfinite = NonFiniteGuard(max_consecutive_skips)
        require(lr > 0, f"lr must be > 0, got {lr}")
        require(style in STYLES, f"unknown style {style!r}; valid: {list(STYLES)}")
        require(max_completion_length is None or max_completion_length >= 1,
                f"max_completion_length must be >= 1 or None, got {max_completion_length}")
        self.model, self.processor = load_vlm(
            model_path, dtype=getattr(torch, dtype), min_pixels=min_pixels, max_pixels=max_pixels
        )
        self.model.train()
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        if system_prompt == "default":
            from mmpo.data import system_prompt_for

            system_prompt = system_prompt_for(style)
        self.system_prompt = system_prompt
        self.engine = HFGenerateEngine(
            self.model, self.processor, system_prompt=system_prompt, max_prompt_length=max_prompt_length
        )

    def configure_optimizers(self):
        h = self.hparams
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else None
        return make_optimizer(self.model.parameters(), lr=h.lr, weight_decay=h.weight_decay,
                              warmup_steps=h.warmup_steps, total_steps=total, schedule=h.lr_schedule)

    def sft_loss(self, rows: Sequence[Mapping[str, Any]]) -> tuple[torch.Tensor, dict[str, float]]:
        """Token-mean NLL of the rendered solutions given the prompts; returns (loss, metrics)."""
        from mmpo.data import render_solution

        h = self.hparams
        prompts = encode_prompts(self.processor, rows, system_prompt=self.system_prompt,
                                 max_prompt_length=h.max_prompt_length)
        targets = [render_solution(dict(row), style=h.style) for row in rows]
        completion_ids, completion_mask = encode_completions(self.processor, targets,
                                                             max_length=h.max_completion_length)
        prompts = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in prompts.items()}
        log_probs, _ = completion_log_probs(
            self.model, prompts, completion_ids.to(self.device), completion_mask.to(self.device),
            chunk_size=h.logprob_chunk_size,
        )
        mask = completion_mask.to(self.device, log_probs.dtype)
        tokens = mask.sum()
        loss = -(log_probs * mask).sum() / tokens.clamp(min=1.0)
        return loss, {"losses/sft": float(loss.detach()), "response/length_mean": float(tokens) / len(rows)}

    def training_step(self, batch: Sequence[Mapping[str, Any]], batch_idx: int) -> torch.Tensor:
        loss, metrics = self.sft_loss(list(batch))
        self.log_dict(metrics, on_step=True, batch_size=len(batch))
        self.log("loss", loss.detach(), prog_bar=True, batch_size=len(batch))
        return loss

    def validation_step(self, batch: Sequence[Mapping[str, Any]], batch_idx: int) -> None:
        """Teacher-forced ``val/loss`` and greedy ``val/accuracy`` on held-out rows."""
        rows = list(batch)
        loss, _ = self.sft_loss(rows)
        metrics = greedy_validation_metrics(self.engine, rows, max_new_tokens=self.hparams.val_max_new_tokens,
                                            timeout_s=self.hparams.reward_timeout_s)
        metrics["val/loss"] = float(loss)
        self.log_dict(metrics, batch_size=len(rows), sync_dist=True, prog_bar=True)
