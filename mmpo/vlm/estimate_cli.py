"""``mmpo estimate -c CONFIG``: the per-device memory budget of a VLM training config.

Reads the same YAML ``mmpo fit`` reads (model settings, their defaults from the module class,
trainer devices / strategy / precision, data batch size) and the model's HF config (no weights);
prints :func:`mmpo.vlm.memory.format_budget`. The arithmetic is in :mod:`mmpo.vlm.memory`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from mmpo.vlm.memory import (
    GB,
    ALL_ARCHITECTURES,
    QWEN25_VL_MAX_PIXELS,
    RunShape,
    estimate_memory,
    format_budget,
    peak_gb,
    resolve_model_dims,
)

# prompt text tokens assumed when a config sets no max_prompt_length (added to the image tokens)
DEFAULT_PROMPT_TEXT_TOKENS = 256
# SFT targets without max_completion_length: an assumed rendered-solution length
DEFAULT_SFT_COMPLETION_TOKENS = 256
_DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "gate_proj")


def module_settings(model_section: Mapping[str, Any]) -> dict[str, Any]:
    """The module's settings: every ``__init__`` default along its class hierarchy, overlaid by ``init_args``."""
    class_path = model_section.get("class_path")
    if not class_path:
        raise ValueError("config has no model.class_path")
    module_name, _, class_name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    settings: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):  # subclasses last: their defaults win
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for name, param in inspect.signature(init).parameters.items():
            if param.default is not inspect.Parameter.empty:
                default = param.default
                # a config group (mmpo.training.config) as the dict of its fields
                is_group = dataclasses.is_dataclass(default) and not isinstance(default, type)
                settings[name] = dataclasses.asdict(default) if is_group else default
    for name, value in (model_section.get("init_args") or {}).items():
        # a group in the config sets some of its fields; the others keep the module's defaults
        both = isinstance(value, Mapping) and isinstance(settings.get(name), Mapping)
        settings[name] = {**settings[name], **value} if both else value
    settings["_is_rl"] = "sampling" in settings
    # frozen whole-policy copies the module holds, where it says (DPO: none; INPO: two); None = the KL rule
    settings["_frozen_policy_copies"] = getattr(cls, "FROZEN_POLICY_COPIES", None)
    settings["_samples_from_frozen_copy"] = bool(getattr(cls, "SAMPLES_FROM_FROZEN_COPY", False))  # INPO's pi_t
    return settings


def _kl_beta(settings: Mapping[str, Any]) -> float:
    """The KL coefficient: the GRPO family's ``loss.beta``, else a flat ``beta`` (DPO's)."""
    loss = settings.get("loss")
    beta = loss.get("beta") if isinstance(loss, Mapping) else settings.get("beta")
    # PPO's KL in the reward needs the same frozen reference (mmpo.algos.ppo: kl_coef)
    return max(float(beta or 0.0), float(settings.get("kl_coef") or 0.0) if isinstance(settings.get("critic"), Mapping)
               else 0.0)


def _devices(trainer: Mapping[str, Any], override: int | None) -> int:
    if override is not None:
        return override
    devices = trainer.get("devices", 1)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"trainer.devices is {devices!r}: pass --devices N")
    return devices * int(trainer.get("num_nodes", 1) or 1)


def _is_sharded(strategy: Any) -> bool:
    """FSDP (Lightning's ``fsdp``) or FSDP2 (``ModelParallelStrategy`` and mmpo's strategy built on it)."""
    name = str(strategy.get("class_path", "") if isinstance(strategy, Mapping) else strategy).lower()
    return "fsdp" in name or "modelparallel" in name or "model_parallel" in name


def _dtypes(settings: Mapping[str, Any], precision: Any) -> tuple[str, str]:
    """(weights dtype, compute dtype) under Lightning's ``precision``."""
    precision = str(precision or "32-true")
    weights = settings.get("dtype") or "float32"
    if precision.startswith("bf16"):
        return ("bfloat16" if precision == "bf16-true" else weights), "bfloat16"
    if precision.startswith("16"):
        return ("float16" if precision == "16-true" else weights), "float16"
    return weights, weights


def _image_pixels(settings: Mapping[str, Any], model_path: str | None, default: int | None) -> int:
    """max_pixels of the config, else of the saved image processor (transformers 5 nests it in
    processor_config.json; older checkpoints have preprocessor_config.json)."""
    import json

    if settings.get("max_pixels"):
        return int(settings["max_pixels"])
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = Path(model_path or "", name)
        if path.is_file():
            saved = json.loads(path.read_text())
            saved = saved.get("image_processor", saved)
            pixels = (saved.get("size") or {}).get("longest_edge") or saved.get("max_pixels")
            if pixels:
                return int(pixels)
    if default is not None:
        return default
    raise ValueError(f"the config sets no max_pixels and {model_path!r} has no saved image processor to read it from")


def run_shape(config: Mapping[str, Any], *, devices: int | None = None, prompt_tokens: int | None = None,
              dims: Any = None, default_pixels: int | None = None) -> RunShape:
    """:class:`RunShape` of a ``mmpo fit`` config (``dims``: the model's, for image-token counts;
    ``default_pixels``: the image size when neither the config nor a saved processor sets max_pixels)."""
    model = config.get("model") or {}
    trainer = config.get("trainer") or {}
    data = (config.get("data") or {}).get("init_args") or {}
    s = module_settings(model)
    n_devices = _devices(trainer, devices)
    weights, compute = _dtypes(s, trainer.get("precision"))
    text_only = bool(getattr(dims, "text_only", False))
    pixels = 0 if text_only else _image_pixels(s, s.get("model_path"), default_pixels)
    batch = int(data.get("batch_size", 8))
    if s["_is_rl"]:
        sampling, optim = s["sampling"], s.get("optim") or {}
        group = int(sampling["num_generations"])
        completion = int(sampling["max_new_tokens"])
        rollout = batch * group
        minibatch = int(optim.get("minibatch_size") or rollout)
        micro = int(optim.get("micro_batch_size") or minibatch)
        accumulates = micro < minibatch
        generation = rollout
        # one on-policy pass keeps each group's completions together; shuffled minibatches (mu > 1 or
        # minibatch_size < rollout) can put up to one completion of each prompt in a micro-batch
        on_policy = int(optim.get("mu") or 1) == 1 and minibatch == rollout
        prompts_per_micro = -(-micro // group) if on_policy else min(micro, batch)
    else:  # SFT: teacher forcing on the batch; greedy generation only in validation
        completion = int(s.get("max_completion_length") or DEFAULT_SFT_COMPLETION_TOKENS)
        micro = batch
        accumulates = int(trainer.get("accumulate_grad_batches", 1) or 1) > 1
        generation = batch
        prompts_per_micro = None  # SFT: every row has its own prompt
    if prompt_tokens is None:
        if s.get("max_prompt_length"):
            prompt_tokens = int(s["max_prompt_length"])
        else:
            merge = dims.patch_size * dims.spatial_merge_size if dims is not None else 28
            prompt_tokens = pixels // merge**2 + DEFAULT_PROMPT_TEXT_TOKENS
    return RunShape(
        micro_batch=micro, prompt_tokens=prompt_tokens, completion_tokens=completion, image_pixels=pixels,
        generation_sequences=generation, dtype=weights, compute_dtype=compute,
        gradient_checkpointing=bool(s.get("gradient_checkpointing")),
        logprob_chunk=int(s.get("logprob_chunk_size") or 1024), beta=_kl_beta(s),
        ref_dtype=s.get("ref_dtype"), ref_offload=bool(s.get("ref_offload")),
        frozen_policy_copies=s.get("_frozen_policy_copies"),
        lora_rank=int(s.get("lora_rank") or 0),
        lora_targets=tuple(s.get("lora_target_modules") or _DEFAULT_LORA_TARGETS),
        freeze_vision_tower=bool(s.get("freeze_vision_tower")), devices=n_devices,
        sharded=_is_sharded(trainer.get("strategy", "auto")) and n_devices > 1, generates=bool(s["_is_rl"]),
        accumulates=accumulates, prompts_per_micro_batch=prompts_per_micro,
        generation_prompts=batch if s["_is_rl"] else None,
        samples_from_frozen_copy=bool(s.get("_samples_from_frozen_copy")),
        critic=_critic(s), critic_lora_rank=int((s.get("critic") or {}).get("lora_rank") or 0) if _critic(s) else 0,
    )


def _critic(settings: Mapping[str, Any]) -> str | None:
    """PPO's value model (a ``critic`` group of mmpo.algos.ppo): "trained", "frozen" (DVPO) or None."""
    critic = settings.get("critic")
    if not isinstance(critic, Mapping) or "frozen" not in critic:
        return None
    return "frozen" if critic["frozen"] else "trained"


def apply_overrides(config: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` settings with dotted keys (``model.init_args.lora_rank=64``); values parsed as YAML."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE with a dotted KEY, got {item!r}")
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ValueError(f"--set {item!r}: {part!r} is not a section of the config")
            node = child
        node[leaf] = yaml.safe_load(value)
    return config


def estimate_config(path: str | Path, *, devices: int | None = None, architecture: str | None = None,
                    prompt_tokens: int | None = None, overrides: Sequence[str] = ()) -> tuple[dict[str, float], str]:
    """``(budget, printed table)`` for the config file at ``path`` (with ``overrides``, see :func:`apply_overrides`)."""
    config = apply_overrides(yaml.safe_load(Path(path).read_text()), overrides)
    model_path = ((config.get("model") or {}).get("init_args") or {}).get("model_path")
    dims, source = resolve_model_dims(model_path, architecture, config_path=path)
    # a known VLM architecture: its processor's max_pixels applies (a text LM counts no image)
    published = "published dimensions" in source and not dims.text_only
    run = run_shape(config, devices=devices, prompt_tokens=prompt_tokens, dims=dims,
                    default_pixels=QWEN25_VL_MAX_PIXELS if published else None)
    budget = estimate_memory(dims, run)
    header = f"mmpo estimate {path}\n  model: {source}"
    settings = module_settings(config.get("model") or {})
    if prompt_tokens is None and not settings.get("max_prompt_length") and not dims.text_only:
        header += (f"\n  prompt length assumed: image tokens + {DEFAULT_PROMPT_TEXT_TOKENS} text tokens "
                   "(set max_prompt_length, or pass --prompt-tokens)")
    return budget, format_budget(budget, dims, run, header=header)


# cards the config comments compare the peak with (GB = 1e9 bytes; an H200 has 141 GB, an A100/H100 80 GB)
CARDS_GB = (80, 141)


def config_comment(budget: Mapping[str, float], command: str) -> str:
    """The memory comment of a real-size config: what ``mmpo estimate`` prints, in three lines.

    ``tests/vlm/test_estimate.py`` checks that every real-size config carries exactly this text.
    """
    def gb(key: str) -> str:
        return f"{budget[key] / GB:.1f}"

    phase = max(("training", "generation", "reference"), key=lambda p: budget[f"peak_{p}"])
    peak = peak_gb(budget)
    fits = [f"fits {card} GB cards" for card in CARDS_GB if peak <= card][:1] or [
        f"does not fit a {CARDS_GB[-1]} GB card"]
    return (
        f"# Memory per device, from `{command}`:\n"
        f"# mmpo estimate: peak {peak} GB per device ({phase} phase; {fits[0]}).\n"
        f"# weights {gb('weights')}, gradients {gb('gradients')}, AdamW {gb('optimizer')}, KL reference "
        f"{gb('reference')}, activations {gb('activations')}\n"
        f"# (checkpointing {gb('activations_checkpointing')}, none {gb('activations_no_checkpointing')}), "
        f"generation KV cache {gb('kv_cache')}"
        + (f", full weights gathered for it {gb('gathered_weights')}" if budget.get("gathered_weights") else "")
        + " GB."
    )


_COMMENT_BLOCK = re.compile(r"# Memory per device, from `mmpo estimate[^\n]*\n(?:# [^\n]*\n){3}")


def update_config_comment(path: str | Path, comment: str) -> None:
    """Replace the config's memory comment block by ``comment`` (written beside it, then renamed into place)."""
    path = Path(path)
    text = path.read_text()
    if not _COMMENT_BLOCK.search(text):
        raise ValueError(f"{path} has no memory comment block (a line '# Memory per device, from `mmpo estimate "
                         "...`:' and three more) to update")
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(_COMMENT_BLOCK.sub(lambda _: comment + "\n", text, count=1))
    os.replace(temporary, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mmpo estimate",
        description="Per-device memory budget (weights, gradients, AdamW, reference, activations, generation) "
                    "of a VLM training config, from the model config alone (no weights are loaded).",
    )
    parser.add_argument("-c", "--config", required=True, help="a mmpo fit YAML config")
    parser.add_argument("--devices", type=int, default=None, help="device count (default: trainer.devices x num_nodes)")
    parser.add_argument("--arch", choices=sorted(ALL_ARCHITECTURES), default=None,
                        help="use published dimensions instead of model_path's config.json")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set model.init_args.lora_rank=64 "
                             "--set trainer.strategy=fsdp (repeatable; VALUE is YAML)")
    parser.add_argument("--comment", action="store_true",
                        help="print the memory comment the real-size configs carry (configs/vlm/*_qwen2_5_vl_*.yaml)")
    parser.add_argument("--update-config", action="store_true",
                        help="with --comment: write that comment into the config, replacing its old one")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="prompt length incl. image tokens (default: max_prompt_length, else image tokens + "
                             f"{DEFAULT_PROMPT_TEXT_TOKENS})")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if not Path(args.config).is_file():
        parser.error(f"no config file {args.config!r}")
    try:
        budget, table = estimate_config(args.config, devices=args.devices, architecture=args.arch,
                                        prompt_tokens=args.prompt_tokens, overrides=args.set)
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    if args.comment:
        if args.set or args.devices is not None or args.prompt_tokens is not None:
            parser.error("--comment describes the config as written: drop --set, --devices and --prompt-tokens")
        command = f"mmpo estimate -c {args.config}" + (f" --arch {args.arch}" if args.arch else "")
        comment = config_comment(budget, command)
        if args.update_config:
            try:
                update_config_comment(args.config, comment)
            except ValueError as error:
                parser.error(str(error))
        print(comment)
        return 0
    print(table)
    print(f"\n  => about {peak_gb(budget)} GB per device at peak (rounded up)")
    return 0
