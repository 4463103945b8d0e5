"""DPO (and IPO, robust DPO, cDPO, hinge) for vision-language models as a Lightning module.

DPO: arXiv 2305.18290. One training step, top to bottom (``training_step``):

1. pairs        a batch of preference rows: image(s) + prompt, ``chosen`` and ``rejected`` texts
                (``mmpo.data.datamodule.PreferenceDataModule``)
2. log-probs    both completions in one forward over [prompt | completion] through the chunked
                log-prob path (``completion_log_probs``: no (B, T, V) logits), summed per sequence
3. reference    the reference log-probs of every training pair, computed ONCE with the initial
                policy before the first step (``on_fit_start``, TRL's ``precompute_ref_log_probs``),
                kept in memory and in checkpoints: no second model is held during training
4. loss         ``mmpo.core.preference_loss`` (``loss_type``: sigmoid, ipo, robust, hinge; ``rpo_alpha``:
                + the chosen completions' token-mean NLL, ``losses/sft``, RPO) and TRL's metrics ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
                ``rewards/accuracies``; AdamW step (automatic optimisation, non-finite guard).

Validation: greedy ``val/accuracy`` / ``val/format`` on held-out prompts, as SFT and GRPO.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from mmpo.algos.config import greedy_validation_metrics, require
from mmpo.algos.vlm_base import VLMPolicyModule
from mmpo.training.config import OptimConfig
from mmpo.core import check_preference_settings, preference_loss
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.processing import encode_completions, encode_prompts, select_rows


def summed_log_probs(model: Any, prompt_inputs: Mapping[str, Any], completion_ids: Tensor, completion_mask: Tensor,
                     *, chunk_size: int, temperature: float = 1.0) -> Tensor:
    """(N,) sequence log-probs: the chunked per-token log-probs summed over each completion's mask."""
    log_probs, _ = completion_log_probs(model, prompt_inputs, completion_ids, completion_mask,
                                        chunk_size=chunk_size, temperature=temperature)
    return (log_probs * completion_mask.to(log_probs)).sum(-1)


class DPOModule(VLMPolicyModule):
    """Offline pairwise preference optimisation (DPO family) of a Qwen-VL policy.

    Args:
        model_path: saved HF model directory (an SFT output or a real checkpoint); also the reference.
        beta: KL strength beta of DPO (IPO: its tau; TRL's default 0.1).
        loss_type: sigmoid (DPO; cDPO with label_smoothing), ipo, robust, hinge (``mmpo.core.PREFERENCE_LOSSES``).
        label_smoothing: assumed label-flip rate eps (sigmoid: cDPO; robust: < 0.5); 0 = plain DPO.
        length_normalize: ipo only: divide each log-ratio by its completion length (TRL's IPO).
        rpo_alpha: weight of the chosen completions' token-mean NLL added to the loss (RPO, arXiv
            2404.19733; TRL 1.16.0's ``loss_type=["sigmoid", "sft"], loss_weights=[1.0, rpo_alpha]``);
            0 = off. The paper uses 1.0.
        optim: AdamW and its schedule (:class:`~mmpo.training.config.OptimConfig`: lr 1e-6 by default as TRL's DPO,
            weight_decay, warmup_steps, lr_schedule).
        max_completion_length: truncate chosen / rejected completions to this many tokens (None = no limit).
        ref_batch_size: pairs per forward when the reference log-probs are precomputed.
        val_max_new_tokens: completion length for greedy validation.
        reward_timeout_s: per reward-function call deadline during validation.
        save_hf_on_checkpoint: also write HF weights to output_dir whenever a Lightning checkpoint is saved.
        **kwargs: the settings every VLM module shares (:class:`~mmpo.algos.vlm_base.VLMPolicyModule`).
    """

    # memory (mmpo estimate): the reference log-probs are computed once by the initial policy, so no frozen
    # copy is held, whatever beta is
    FROZEN_POLICY_COPIES = 0

    def __init__(
        self,
        model_path: str,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        length_normalize: bool = False,
        rpo_alpha: float = 0.0,
        optim: OptimConfig = OptimConfig(),
        max_completion_length: int | None = None,
        ref_batch_size: int = 8,
        val_max_new_tokens: int = 64,
        reward_timeout_s: float = 10.0,
        save_hf_on_checkpoint: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(model_path, optim=optim, save_hf_on_checkpoint=save_hf_on_checkpoint, **kwargs)
        self.ref_log_probs: dict[str, tuple[float, float]] = {}  # row id -> (log pi_ref(chosen), log pi_ref(rejected))

    def _validate_settings(self) -> None:
        h = self.hparams
        check_preference_settings(h.loss_type, h.beta, h.label_smoothing)
        require(not h.length_normalize or h.loss_type == "ipo",
                f"length_normalize is TRL's IPO normalisation; it needs loss_type 'ipo', not {h.loss_type!r}")
        require(h.max_completion_length is None or h.max_completion_length >= 1,
                f"max_completion_length must be >= 1 or None, got {h.max_completion_length}")
        require(h.ref_batch_size >= 1, f"ref_batch_size must be >= 1, got {h.ref_batch_size}")
        require(h.rpo_alpha >= 0, f"rpo_alpha must be >= 0, got {h.rpo_alpha}")

    # ------------------------------------------------------------------ log-probs

    def pair_log_probs(self, model: Any, rows: Sequence[Mapping[str, Any]]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(chosen, rejected) sequence log-probs (P,) under ``model`` and their token counts (P,)."""
        h = self.hparams
        for row in rows:
            if not isinstance(row.get("chosen"), str) or not isinstance(row.get("rejected"), str):
                raise ValueError(f"row {row.get('id')!r} has no 'chosen' / 'rejected' completion: DPO trains on "
                                 "preference pairs (data: mmpo.data.datamodule.PreferenceDataModule)")
        prompts = encode_prompts(self.processor, rows, system_prompt=self.system_prompt,
                                 max_prompt_length=h.max_prompt_length)
        texts = [row["chosen"] for row in rows] + [row["rejected"] for row in rows]
        ids, mask = encode_completions(self.processor, texts, max_length=h.max_completion_length)
        both = select_rows(prompts, torch.arange(len(rows)).repeat(2))  # [chosen pairs | rejected pairs]
        both = {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in both.items()}
        logps = summed_log_probs(model, both, ids.to(self.device), mask.to(self.device),
                                 chunk_size=h.logprob_chunk_size)
        lengths = mask.sum(-1).to(self.device)
        return (*logps.chunk(2), *lengths.chunk(2))

    @torch.no_grad()
    def precompute_reference(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Reference log-probs of every pair in ``rows`` with the current (initial) weights, once."""
        was_training = self.model.training
        self.model.eval()
        try:
            rows = list(rows)
            for start in range(0, len(rows), self.hparams.ref_batch_size):
                part = rows[start : start + self.hparams.ref_batch_size]
                chosen, rejected, _, _ = self.pair_log_probs(self.model, part)
                for row, c, r in zip(part, chosen.tolist(), rejected.tolist()):
                    if row["id"] in self.ref_log_probs:
                        raise ValueError(f"duplicate pair id {row['id']!r}: reference log-probs are keyed by row id")
                    self.ref_log_probs[row["id"]] = (c, r)
        finally:
            self.model.train(was_training)

    def on_fit_start(self) -> None:
        if self.ref_log_probs:  # restored from a checkpoint: computed by the initial policy already
            return
        datamodule = getattr(self.trainer, "datamodule", None)
        rows = getattr(datamodule, "train_rows", None)
        if rows is None:
            raise ValueError("DPOModule precomputes the reference log-probs of every training pair before the "
                             "first step: fit it with a datamodule that has train_rows (PreferenceDataModule)")
        self.precompute_reference(rows)

    def _reference_for(self, rows: Sequence[Mapping[str, Any]]) -> tuple[Tensor, Tensor]:
        missing = [row["id"] for row in rows if row["id"] not in self.ref_log_probs]
        if missing:
            raise KeyError(f"no reference log-probs for pair(s) {missing[:3]}: they were not among the datamodule's "
                           "train_rows when the reference was precomputed")
        values = torch.tensor([self.ref_log_probs[row["id"]] for row in rows], device=self.device)
        return values[:, 0], values[:, 1]

    # ------------------------------------------------------------------ the step

    def dpo_loss(self, rows: Sequence[Mapping[str, Any]]) -> tuple[Tensor, dict[str, float]]:
        """The configured DPO-family loss of a batch of pairs and its metrics."""
        h = self.hparams
        chosen, rejected, chosen_len, rejected_len = self.pair_log_probs(self.model, rows)
        ref_chosen, ref_rejected = self._reference_for(rows)
        return preference_loss(h.loss_type, chosen, rejected, ref_chosen, ref_rejected, beta=h.beta,
                               label_smoothing=h.label_smoothing, length_normalize=h.length_normalize,
                               chosen_lengths=chosen_len, rejected_lengths=rejected_len, rpo_alpha=h.rpo_alpha)

    def training_step(self, batch: Sequence[Mapping[str, Any]], batch_idx: int) -> Tensor:
        rows = list(batch)
        loss, metrics = self.dpo_loss(rows)
        shown = {"rewards/accuracies", "rewards/margins"}
        self.log_dict({k: v for k, v in metrics.items() if k in shown}, on_step=True, prog_bar=True, batch_size=len(rows))
        self.log_dict({k: v for k, v in metrics.items() if k not in shown}, on_step=True, batch_size=len(rows))
        self.log("loss", loss.detach(), batch_size=len(rows))
        return loss

    def validation_step(self, batch: Sequence[Mapping[str, Any]], batch_idx: int) -> None:
        """Greedy ``val/accuracy`` and ``val/format`` on held-out prompts."""
        rows = list(batch)
        metrics = greedy_validation_metrics(self.engine, rows, max_new_tokens=self.hparams.val_max_new_tokens,
                                            timeout_s=self.hparams.reward_timeout_s)
        self.log_dict(metrics, batch_size=len(rows), sync_dist=True, prog_bar=True)

    # ------------------------------------------------------------------ checkpoints

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # the reference log-probs came from the initial weights, which a resumed run no longer has
        ids = list(self.ref_log_probs)
        checkpoint["mmpo_ref_log_probs"] = {"ids": ids, "values": torch.tensor([self.ref_log_probs[i] for i in ids])}
        super().on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("mmpo_ref_log_probs")
        if saved is not None:
            self.ref_log_probs = {i: (float(c), float(r)) for i, (c, r) in zip(saved["ids"], saved["values"].tolist())}
        super().on_load_checkpoint(checkpoint)
