"""Checkpoints written before the one-update-engine change (2026-12-05), read as today's modules expect.

Two things moved (docs/moved.md): the packages ``dllm`` / ``robotics`` became ``mmpo.dllm`` /
``mmpo.robotics``, and flat module arguments became fields of config groups (``num_generations``
-> ``sampling.num_generations``). A checkpoint stores its module's ``_class_path`` and arguments
as they were, so without this a resume compares the old class path with the new one (and refuses
it as a model change) and compares ``num_generations`` with nothing (and lets a changed group
size through). :func:`upgrade_saved_hparams` rewrites both before anything reads them; the
tensors are untouched.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Mapping

MOVED_PACKAGES: dict[str, str] = {"dllm.": "mmpo.dllm.", "robotics.": "mmpo.robotics."}
"""Old class-path prefix -> new prefix."""

# Old flat argument -> (group, field), per module class (subclasses inherit their bases' rows).
FLAT_TO_GROUPED: dict[str, dict[str, tuple[str, str]]] = {
    "mmpo.algos.vlm_base.VLMPolicyModule": {
        "num_generations": ("sampling", "num_generations"),
        "max_new_tokens": ("sampling", "max_new_tokens"),
        "temperature": ("sampling", "temperature"),
        "top_p": ("sampling", "top_p"),
        "val_max_new_tokens": ("sampling", "val_max_new_tokens"),
        "loss": ("loss", "name"),
        "clip_low": ("loss", "clip_low"),
        "clip_high": ("loss", "clip_high"),
        "dual_clip": ("loss", "dual_clip"),
        "loss_settings": ("loss", "settings"),
        "agg": ("loss", "agg"),
        "norm_len": ("loss", "norm_len"),
        "kl_kind": ("loss", "kl_kind"),
        "beta": ("loss", "beta"),
        "entropy_coef": ("loss", "entropy_coef"),
        "advantage": ("advantage", "name"),
        "advantage_eps": ("advantage", "eps"),
        "dynamic_sampling": ("advantage", "dynamic_sampling"),
        "dynamic_sampling_retries": ("advantage", "dynamic_sampling_retries"),
        "lr": ("optim", "lr"),
        "weight_decay": ("optim", "weight_decay"),
        "warmup_steps": ("optim", "warmup_steps"),
        "lr_schedule": ("optim", "lr_schedule"),
        "max_grad_norm": ("optim", "max_grad_norm"),
        "mu": ("optim", "mu"),
        "minibatch_size": ("optim", "minibatch_size"),
        "micro_batch_size": ("optim", "micro_batch_size"),
        "rollout_is": ("rollout_correction", "mode"),
        "rollout_is_cap": ("rollout_correction", "cap"),
        "rollout_is_cap_low": ("rollout_correction", "cap_low"),
        "rollout_bypass": ("rollout_correction", "bypass"),
        "rollout_engine": ("rollout_engine", "name"),
        "vllm_max_model_len": ("rollout_engine", "vllm_max_model_len"),
        "vllm_max_num_batched_tokens": ("rollout_engine", "vllm_max_num_batched_tokens"),
        "vllm_gpu_memory_utilization": ("rollout_engine", "vllm_gpu_memory_utilization"),
        "reward_weights": ("rewards", "weights"),
        "reward_timeout_s": ("rewards", "timeout_s"),
    },
}


def _registered_rows() -> dict[str, dict[str, tuple[str, str]]]:
    """:data:`FLAT_TO_GROUPED` plus the robot modules' tables (kept beside their configs in
    ``mmpo.robotics.config``, read lazily: that package is an optional extra's)."""
    rows = dict(FLAT_TO_GROUPED)
    try:
        from mmpo.robotics.config import DPPO_FLAT_NAMES, GAUSSIAN_FLAT_NAMES
    except ImportError:
        return rows
    rows["mmpo.robotics.dppo.DPPOModule"] = DPPO_FLAT_NAMES
    rows["mmpo.robotics.gaussian_ppo.GaussianPPOModule"] = GAUSSIAN_FLAT_NAMES
    return rows


def upgrade_class_path(class_path: str) -> str:
    """``dllm.rl.DiffuGRPO`` -> ``mmpo.dllm.rl.DiffuGRPO``; other paths unchanged."""
    for old, new in MOVED_PACKAGES.items():
        if class_path.startswith(old):
            return new + class_path[len(old):]
    return class_path


def _module_class(class_path: str) -> type | None:
    module_name, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return None


def flat_to_grouped_for(class_path: str) -> dict[str, tuple[str, str]]:
    """The :data:`FLAT_TO_GROUPED` rows of ``class_path`` and its base classes, restricted to the
    groups its constructor takes (a module that still takes ``lr`` flat keeps it)."""
    registered = _registered_rows()
    cls = _module_class(class_path)
    if cls is None:
        return dict(registered.get(class_path, {}))
    rows: dict[str, tuple[str, str]] = {}
    for base in reversed(cls.__mro__):
        rows.update(registered.get(f"{base.__module__}.{base.__qualname__}", {}))
    parameters = inspect.signature(cls.__init__).parameters
    groups = {group for group, _ in rows.values()}
    # an old name that is today's group name (``loss``) is still moved: its plain value is the old argument
    return {old: (group, field) for old, (group, field) in rows.items()
            if group in parameters and (old not in parameters or old in groups)}


def upgrade_saved_hparams(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's ``hyper_parameters`` with the old class path and the old flat arguments moved to
    today's names (a copy; already-current hyperparameters come back equal)."""
    out = dict(saved)
    class_path = out.get("_class_path")
    if not isinstance(class_path, str):
        return out
    out["_class_path"] = class_path = upgrade_class_path(class_path)
    if class_path.startswith("mmpo.dllm."):
        # the dLLM settings moved with changes of meaning (ratio_level -> loss.name, correct_reward ->
        # rewards.weights): their own mapping, kept beside their configs
        from mmpo.dllm.config import grouped_hparams, is_flat_hparams

        return grouped_hparams(out) if is_flat_hparams(out) else out
    rows = flat_to_grouped_for(class_path)
    # Some old names are today's group names (``loss``, ``advantage``, ``rollout_engine``): a plain value under
    # such a key is the old flat argument, a mapping is already the group. Take every flat value out first.
    flat = {old: out.pop(old) for old in rows if old in out and not isinstance(out[old], Mapping)}
    for old, value in flat.items():
        group, field = rows[old]
        current = out.get(group)
        grouped = dict(current) if isinstance(current, Mapping) else {}
        grouped.setdefault(field, value)  # a value already in its group is the newer one
        out[group] = grouped
    return out
