"""Validation and export hooks shared by the dLLM Lightning modules (SFT warm-up and RL).

Both validate by greedy held-out accuracy and write the model with ``save_pretrained`` after
every real validation and at the end of training, into an export directory that belongs to one
run (``mmpo.training.export_guard``). Mixed in before ``LightningModule``; expects ``self.model``,
``self.tokenizer``, ``self.sampler`` and ``self.save_dir``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmpo.dllm.modeling import generation_dict, save_mask_predictor
from mmpo.dllm.rollout import greedy_accuracy
from mmpo.dllm.sampler import SamplerConfig
from mmpo.training.export_guard import ExportOwnershipMixin


class MaskPredictorExportHooks(ExportOwnershipMixin):
    """``val/accuracy`` (greedy) and ``save_pretrained`` exports to ``save_dir`` (global rank 0 only)."""

    def export_sampler(self) -> SamplerConfig:
        """Generation defaults written next to the weights (hook: RL exports greedy decoding)."""
        return self.sampler

    def validation_step(self, rows: list[dict[str, Any]], batch_idx: int) -> None:
        accuracy = greedy_accuracy(self.model, self.tokenizer, rows, self.sampler, batch_size=len(rows))
        self.log("val/accuracy", accuracy, prog_bar=True, batch_size=len(rows))

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:  # never export an untrained model
            self.export()

    def on_train_end(self) -> None:
        self.export()

    def export(self, path: str | Path | None = None) -> None:
        """Write the model and tokenizer with ``save_pretrained`` (only from global rank 0)."""
        if self._trainer is not None and self.trainer.global_rank != 0:  # export() also works unattached
            return
        target = path or self.save_dir
        self.claim_export_dir(target)
        save_mask_predictor(self.model, self.tokenizer, target, generation=generation_dict(sampler=self.export_sampler()))
        self.mark_export_dir(target)

    def export_dir(self) -> str:
        return self.save_dir
