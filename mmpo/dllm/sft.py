"""LLaDA's SFT loss and the Lightning module of the SFT warm-up stage.

LLaDA (arXiv 2502.09992, ``ML-GSAI/LLaDA:GUIDELINES.md``): draw t ~ U(0, 1) per sequence,
p = (1 - eps) t + eps (eps = 1e-3); mask each *answer* token independently with
probability p (the prompt is never masked; EOS padding up to the generation length counts
as answer and is trained); loss = sum over masked answer tokens of CE / p, divided by the
answer length, averaged over the batch. IGPO's Length-Aligned SFT stage (docs/algorithm_sources.md section 17.6)
uses this loss on traces sized to the RL generation budget: our traces are EOS-padded to
exactly ``gen_length``.

Why not ``BlockRefinementScheduler.add_noise``: it draws a separate mask ratio per block
(LLaDA2's block-wise training); LLaDA/IGPO use one t per sequence.
"""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor

from mmpo.dllm.modeling import (
    TinyMaskPredictorConfig,
    build_tiny_mask_predictor,
    encode_completions,
    encode_prompts,
    load_mask_predictor,
    mask_predictor_logits,
    mask_token_id,
)
from mmpo.dllm.checkpoint_hparams import LegacyHparamsMixin, PlainHparamsMixin, as_config
from mmpo.dllm.config import SFT_OPTIM
from mmpo.dllm.export_hooks import MaskPredictorExportHooks
from mmpo.training.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS, NonFiniteGuard, NonFiniteGuardMixin
from mmpo.dllm.sampler import SamplerConfig
from mmpo.dllm.task import ArithmeticTaskConfig, corpus
from mmpo.dllm.tokenizer import train_char_tokenizer
from mmpo.training.config import OptimConfig
from mmpo.training.config import as_config as as_group  # a group over the module's default instance
from mmpo.training.optim import make_optimizer, max_steps_or_none


def sft_forward_process(
    answers: Tensor, mask_token_id: int, *, eps: float = 1e-3, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Mask each answer token with probability p = (1 - eps) t + eps, t ~ U(0, 1) per row.

    Args:
        answers: ``(batch, L)`` answer ids (EOS-padded).
    Returns:
        ``(noisy (batch, L), masked (batch, L) bool, p_mask (batch,))``.
    """
    batch, length = answers.shape
    t = torch.rand(batch, generator=generator).to(answers.device)
    p_mask = (1.0 - eps) * t + eps
    masked = torch.rand((batch, length), generator=generator).to(answers.device) < p_mask[:, None]
    noisy = torch.where(masked, torch.full_like(answers, mask_token_id), answers)
    return noisy, masked, p_mask


def llada_sft_loss(answer_logits: Tensor, answers: Tensor, masked: Tensor, p_mask: Tensor) -> Tensor:
    """LLaDA SFT loss: mean over rows of (sum_{masked j} CE_j / p) / answer length.

    Args:
        answer_logits: ``(batch, L, vocab)`` logits at the answer positions.
        answers: ``(batch, L)`` clean answer ids.
        masked: ``(batch, L)`` bool, which answer tokens were masked.
        p_mask: ``(batch,)`` each row's mask probability.
    Returns:
        0-d loss.
    """
    ce = F.cross_entropy(answer_logits.float().transpose(1, 2), answers, reduction="none")  # (batch, L)
    per_row = (ce * masked.float()).sum(dim=1) / p_mask / answers.shape[1]
    return per_row.mean()


def _check_sft_optim(optim: OptimConfig) -> None:
    """The SFT module makes one optimizer step per batch and leaves clipping to the trainer: refuse the
    update-loop fields it would ignore."""
    if optim.mu != 1:
        raise ValueError(f"optim.mu must be 1 for SFT (one optimizer step per batch), got {optim.mu}")
    for name in ("minibatch_size", "micro_batch_size"):
        if getattr(optim, name) is not None:
            raise ValueError(f"optim.{name} must be null for SFT (one optimizer step per batch), got {getattr(optim, name)}")
    if optim.max_grad_norm:
        raise ValueError(f"optim.max_grad_norm must be 0 for SFT, got {optim.max_grad_norm}; "
                         "clip with trainer.gradient_clip_val")


class MaskedDiffusionSFT(LegacyHparamsMixin, NonFiniteGuardMixin, MaskPredictorExportHooks, PlainHparamsMixin,
                         pl.LightningModule):
    """SFT warm-up of a masked-diffusion LM on reference traces (LLaDA SFT loss).

    Args:
        save_dir: where the trained model is written with ``save_pretrained`` (the RL configs read it).
        init_from: load this checkpoint instead of building a tiny model (e.g. a LLaDA folder).
        trust_remote_code: allow the checkpoint's own code (only when ``init_from`` needs it).
        tiny: size of the tiny model built when ``init_from`` is None.
        tokenizer_task: task whose corpus trains the tiny model's tokenizer.
        sampler: generation settings (validation decodes greedily with them; saved as defaults).
        optim: AdamW and its schedule (:class:`~mmpo.training.config.OptimConfig`; defaults lr 1e-3,
            weight_decay 0.01, betas (0.9, 0.999), warmup_steps 50, lr_schedule constant). One optimizer step per
            batch (Lightning's automatic optimization): mu must be 1, minibatch_size / micro_batch_size null, and
            max_grad_norm 0 (clip with ``trainer.gradient_clip_val``).
        mask_eps: LLaDA's eps in p = (1 - eps) t + eps.
        seed: seed of the masking RNG and of the tiny model's initialisation.
        max_consecutive_skips: optimizer steps with a non-finite loss or gradient norm are skipped (weights and
            optimizer state untouched, counted as perf/skipped_steps); this many in a row stop the run with
            NonFiniteTrainingError (mmpo.training.nonfinite).
        overwrite_output: allow exporting into a save_dir that holds another run's export (refused otherwise).
    """

    def __init__(
        self,
        save_dir: str = "runs/dllm/sft_tiny/model",
        init_from: str | None = None,
        trust_remote_code: bool = False,
        tiny: TinyMaskPredictorConfig | None = None,
        tokenizer_task: ArithmeticTaskConfig | None = None,
        sampler: SamplerConfig | None = None,
        optim: OptimConfig = SFT_OPTIM,
        mask_eps: float = 1e-3,
        seed: int = 0,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
        overwrite_output: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.optim = as_group(optim, SFT_OPTIM)
        self.hparams["optim"] = dataclasses.asdict(self.optim)  # a plain dict in checkpoints (weights_only loads)
        _check_sft_optim(self.optim)
        self.nonfinite = NonFiniteGuard(max_consecutive_skips)
        self.save_dir = save_dir
        self.sampler = as_config(sampler, SamplerConfig)
        self.mask_eps = mask_eps
        if init_from:
            self.model, self.tokenizer = load_mask_predictor(init_from, trust_remote_code=trust_remote_code)
        else:
            torch.manual_seed(seed)
            self.tokenizer = train_char_tokenizer(corpus(as_config(tokenizer_task, ArithmeticTaskConfig)))
            self.model = build_tiny_mask_predictor(self.tokenizer, as_config(tiny, TinyMaskPredictorConfig))
        self.mask_id = mask_token_id(self.tokenizer, self.model)
        self.generator = torch.Generator().manual_seed(seed)

    def training_step(self, batch: list[dict[str, str]], batch_idx: int) -> Tensor:
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, [r["problem"] for r in batch])
        answers = encode_completions(self.tokenizer, [r["trace"] for r in batch], self.sampler.gen_length)
        prompt_ids, prompt_mask, answers = prompt_ids.to(self.device), prompt_mask.to(self.device), answers.to(self.device)
        noisy, masked, p_mask = sft_forward_process(answers, self.mask_id, eps=self.mask_eps, generator=self.generator)
        input_ids = torch.cat([prompt_ids, noisy], dim=1)
        attention = torch.cat([prompt_mask, torch.ones_like(noisy)], dim=1)
        logits = mask_predictor_logits(self.model, input_ids, attention)[:, prompt_ids.shape[1] :]
        loss = llada_sft_loss(logits, answers, masked, p_mask)
        self.log("losses/sft", loss, prog_bar=True, batch_size=len(batch))
        return loss

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["mask_generator_state"] = self.generator.get_state()  # the noise draws continue on resume

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "mask_generator_state" in checkpoint:
            self.generator.set_state(checkpoint["mask_generator_state"])
        super().on_load_checkpoint(checkpoint)  # the run id

    def configure_optimizers(self):
        optim = self.optim
        return make_optimizer(self.model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay, betas=optim.betas,
                              warmup_steps=optim.warmup_steps, schedule=optim.lr_schedule,
                              total_steps=max_steps_or_none(self))
