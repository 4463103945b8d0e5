"""The part every VLM Lightning module shares: its settings, the policy, the engine, the optimizer.

``SFTModule`` and ``GRPOModule`` (and through it every RL algorithm) subclass
:class:`VLMPolicyModule`: the settings below are declared once, here. LightningCLI still lists
each of them as a typed argument of every subclass (jsonargparse follows ``**kwargs`` into
``super().__init__``); the grouped ones (``optim``, and GRPO's ``sampling``, ``loss`` ...) are the
dataclasses of mmpo.training.config, nested under ``model.init_args``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import lightning as L
import torch

from mmpo.algos.config import VLMCheckpointHooks, require
from mmpo.training.optim import make_optimizer, max_steps_or_none
from mmpo.training.config import OptimConfig, as_config
from mmpo.training.lora import LoraSettings, unwrap, wrap_with_lora
from mmpo.training.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS, NonFiniteGuard, NonFiniteGuardMixin
from mmpo.training.fsdp import FSDP2Strategy, check_sharding_support
from mmpo.vlm.factory import load_vlm, vision_tower_prefixes
from mmpo.vlm.fsdp import is_sharded, shard_vlm
from mmpo.vlm.logprobs import DEFAULT_LOGPROB_CHUNK
from mmpo.vlm.rollout import HFGenerateEngine


class VLMPolicyModule(NonFiniteGuardMixin, VLMCheckpointHooks, L.LightningModule):
    """A Qwen-VL policy loaded from ``model_path`` with its generation engine and AdamW + schedule.

    Subclasses check their own settings in ``_validate_settings`` (called before the model loads,
    with ``self.hparams`` set) and may resolve ``system_prompt="default"`` in ``_resolve_system_prompt``.

    Args:
        model_path: saved HF model directory (``build_tiny_vlm`` output, an SFT output, or a real checkpoint).
        optim: AdamW and its learning-rate schedule (:class:`~mmpo.training.config.OptimConfig`: lr, weight_decay,
            warmup_steps, lr_schedule; the GRPO family also reads max_grad_norm, mu, minibatch_size,
            micro_batch_size). Each subclass declares it with its own default (SFT: lr 1e-4).
        max_prompt_length: refuse prompts longer than this (never truncated); None = no limit.
        logprob_chunk_size: token positions per chunk of the vocabulary projection.
        min_pixels: image processor min pixels override (None = saved processor's).
        max_pixels: image processor max pixels override (None = saved processor's).
        dtype: model weights dtype (float32 on CPU; bfloat16 on GPU).
        gradient_checkpointing: recompute activations in backward to save memory.
        system_prompt: "default" = the module's default system prompt; empty = none.
        output_dir: where HF weights (model + processor) are written; None = not saved.
        save_hf_on_checkpoint: also write HF weights to output_dir whenever a Lightning checkpoint is saved.
        overwrite_output: allow exporting into an output_dir that holds another run's export (refused otherwise).
        max_consecutive_skips: optimizer steps with a non-finite loss or gradient norm are skipped (weights and
            optimizer state untouched, counted as perf/skipped_steps); this many in a row stop the run with
            NonFiniteTrainingError (mmpo.training.nonfinite).
        lora_rank: train a peft LoRA adapter of this rank instead of all weights; 0 = full fine-tuning
            (EasyR1's ``lora_rank``). With LoRA the KL reference is the adapter-disabled policy (no copy) and
            the export is merged weights plus the adapter alone in ``output_dir/adapter``.
        lora_alpha: LoRA scaling numerator: the update is (lora_alpha / lora_rank) * B A.
        lora_dropout: dropout on the adapter input.
        lora_target_modules: names (suffixes) of the Linear layers that get an adapter (Qwen-VL: q_proj, k_proj,
            v_proj, o_proj, gate_proj, up_proj, down_proj; the vision tower's are qkv, proj, gate/up/down_proj).
        freeze_vision_tower: the vision tower is not trained (EasyR1's ``freeze_vision_tower``): its weights get
            no gradient, and with LoRA it gets no adapter.
    """

    config_groups: tuple[str, ...] = ("optim",)
    """Attributes holding the module's config dataclasses (mmpo.training.config); a subclass that takes more
    groups sets them before calling ``super().__init__`` and lists them here."""

    def __init__(
        self,
        model_path: str,
        *,
        optim: OptimConfig | Mapping[str, Any],
        save_hf_on_checkpoint: bool,
        max_prompt_length: int | None = None,
        logprob_chunk_size: int = DEFAULT_LOGPROB_CHUNK,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        dtype: str = "float32",
        gradient_checkpointing: bool = False,
        system_prompt: str | None = "default",
        output_dir: str | None = None,
        overwrite_output: bool = False,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
        lora_rank: int = 0,
        lora_alpha: int = 64,
        lora_dropout: float = 0.0,
        lora_target_modules: list[str] | None = None,
        freeze_vision_tower: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # also the subclasses' own init arguments (Lightning walks their frames)
        self.optim = as_config(optim, OptimConfig())
        # the config groups (``self.optim``, a subclass's ``self.sampling`` ...) go into hparams (and so into
        # checkpoints) as plain dicts: a checkpoint loads with weights_only=True and its dicts build them back
        for name in self.config_groups:  # a group may be None where the module allows it (T-PPO's critic)
            group = getattr(self, name)
            self.hparams[name] = None if group is None else dataclasses.asdict(group)
        self.nonfinite = NonFiniteGuard(max_consecutive_skips)
        require(lora_rank >= 0, f"lora_rank must be >= 0 (0 = no LoRA), got {lora_rank}")
        self._validate_settings()  # before the (slow) model load
        self.model, self.processor = load_vlm(
            model_path, dtype=getattr(torch, dtype), min_pixels=min_pixels, max_pixels=max_pixels
        )
        self.model.train()
        vision = vision_tower_prefixes(self.model) if freeze_vision_tower else []
        for name, param in self.model.named_parameters():
            if name.startswith(tuple(vision)):
                param.requires_grad_(False)
        if lora_rank:
            # a fixed adapter initialisation: every process of a sharded (FSDP2) run starts from the same one
            settings = LoraSettings(r=lora_rank, alpha=lora_alpha, dropout=lora_dropout, init_seed=0)
            if lora_target_modules is not None:
                settings.target_modules = list(lora_target_modules)
            self.model = wrap_with_lora(self.model, settings, exclude_prefixes=vision)
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.system_prompt = self._resolve_system_prompt(system_prompt)
        # generate through the transformers model: peft injects the adapters into it in place
        self.engine = HFGenerateEngine(
            unwrap(self.model), self.processor, system_prompt=self.system_prompt, max_prompt_length=max_prompt_length
        )

    def _validate_settings(self) -> None:
        """Hook: check the subclass's settings (``self.hparams``) before the model loads."""

    def configure_model(self) -> None:
        """Under ``FSDP2Strategy``: shard the policy and the models of :meth:`_models_to_shard` with FSDP2
        (mmpo.vlm.fsdp; called by Lightning before the optimizers exist). Other strategies: nothing to do;
        Lightning's FSDP1 ``fsdp`` and tensor parallelism are refused (``check_sharding_support``)."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        check_sharding_support(strategy)
        if not isinstance(strategy, FSDP2Strategy) or is_sharded(self.model):
            return
        mesh = self.device_mesh["data_parallel"]
        shard_vlm(self.model, mesh)
        for model in self._models_to_shard():
            shard_vlm(model, mesh, frozen=True)

    def _models_to_shard(self) -> list[torch.nn.Module]:
        """Hook: frozen models besides the policy that FSDP2 shards too (GRPO's KL reference)."""
        return []

    def _resolve_system_prompt(self, system_prompt: str | None) -> str | None:
        """Hook: the system prompt the engine uses ("default" is resolved by the engine)."""
        return system_prompt

    def configure_optimizers(self) -> dict[str, Any]:
        return make_optimizer(self.model.parameters(), lr=self.optim.lr, weight_decay=self.optim.weight_decay,
                              betas=self.optim.betas, fused=True, warmup_steps=self.optim.warmup_steps, total_steps=max_steps_or_none(self),
                              schedule=self.optim.lr_schedule)
