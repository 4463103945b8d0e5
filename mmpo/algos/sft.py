"""Supervised fine-tuning (SFT warm-up) of a VLM on rendered reference solutions.

Teacher forcing on ``render_solution(row)`` + ``<|im_end|>``; the loss is the token-mean
negative log-likelihood of the completion tokens only (prompt and image tokens carry
no loss). Log-probs go through the same chunked path as GRPO (``completion_log_probs``),
so the full (B, T, V) logits tensor is never built. The result is saved in HF format
(``save_pretrained`` of model and processor) for the next stage (GRPO, ``mmpo eval``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from mmpo.algos.config import greedy_validation_metrics, require
from mmpo.algos.vlm_base import VLMPolicyModule
from mmpo.training.config import OptimConfig, as_config
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.processing import encode_completions, encode_prompts

STYLES = ("think-answer", "steps", "answer")


class SFTModule(VLMPolicyModule):
    """Teacher-forced SFT on reference solutions (loss on completion tokens only).

    Args:
        model_path: saved HF model directory (e.g. ``build_tiny_vlm`` output or a real checkpoint).
        optim: AdamW and its schedule (:class:`~mmpo.training.config.OptimConfig`: lr 1e-4 by default, weight_decay,
            warmup_steps, lr_schedule).
        style: solution style taught: think-answer (default), steps (StepGRPO) or answer (the row's answer
            alone, no system prompt: a text rewriter such as the TAROT testbed's).
        max_completion_length: truncate target completions to this many tokens (None = no limit).
        val_max_new_tokens: completion length for greedy validation.
        save_hf_on_checkpoint: also write HF weights to output_dir whenever a Lightning checkpoint is saved.
        reward_timeout_s: per reward-function call deadline during validation.
        **kwargs: the settings every VLM module shares (:class:`~mmpo.algos.vlm_base.VLMPolicyModule`:
            dtype, system_prompt ("default" = the prompt of
            ``style``), output_dir, ...).
    """

    def __init__(
        self,
        model_path: str,
        optim: OptimConfig = OptimConfig(lr=1e-4),
        style: str = "think-answer",
        max_completion_length: int | None = None,
        val_max_new_tokens: int = 64,
        save_hf_on_checkpoint: bool = True,
        reward_timeout_s: float = 10.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(model_path, optim=as_config(optim, OptimConfig(lr=1e-4)),
                         save_hf_on_checkpoint=save_hf_on_checkpoint, **kwargs)

    def _validate_settings(self) -> None:
        h = self.hparams
        require(h.style in STYLES, f"unknown style {h.style!r}; valid: {list(STYLES)}")
        require(h.max_completion_length is None or h.max_completion_length >= 1,
                f"max_completion_length must be >= 1 or None, got {h.max_completion_length}")

    def _resolve_system_prompt(self, system_prompt: str | None) -> str | None:
        if system_prompt == "default":
            from mmpo.data import system_prompt_for

            return system_prompt_for(self.hparams.style)
        return system_prompt

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
