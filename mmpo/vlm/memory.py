"""Per-device memory budget of a VLM run, from the model config alone (``mmpo estimate``).

No weights are loaded: the model is instantiated on torch's ``meta`` device from its HF config
(``AutoConfig`` of a local checkpoint, or a Qwen2.5-VL config built from its published
dimensions), which gives exact parameter counts and every Linear layer's shape (for LoRA).

What is counted, per device, in bytes (GB below means 1e9 bytes):

- weights, gradients (live from the first backward of an optimizer step to the step itself), AdamW's
  two moment buffers (in the parameters' dtype, as ``torch.optim.AdamW``
  keeps them), for the trained parameters only (all, all but a frozen vision tower, or the LoRA
  adapters); divided by the device count under a sharding strategy (FSDP / FSDP2), whole under DDP;
- the KL reference: a frozen copy in ``ref_dtype`` (none with LoRA or ``beta: 0``; not on the device
  between passes with ``ref_offload``, on it during its log-prob pass);
- autocast's weight cache: under ``precision: bf16-mixed`` with float32 weights, each weight a
  forward uses is kept in bf16 until the forward ends;
- training activations of one micro-batch (completions x (prompt + completion) tokens and one
  image per completion through the vision tower), with or without gradient checkpointing;
- the chunked log-prob projection (``mmpo.core.logprobs``: one chunk x vocabulary slab at a time);
- generation: the KV cache of all sequences sampled at once (prompts per device x G) at full length
  (the buffers of the HF engine's lean decoding loop, ``mmpo.vlm.rollout._GrowingKVCache``, filled
  from the one-row-per-prompt prefill cache), the last-position logits, and the prefill's largest
  transient. Where HF ``generate`` decodes instead (``HFGenerateEngine.last_decode`` names why), it
  also holds the prefilled cache expanded to the G rows and ``DynamicCache``'s per-step copies: on
  the tiny model 6.57 MiB against the lean loop's 4.48 (tests/vlm/test_estimate.py). Sharded (FSDP2),
  the sampling model's full weights too: ``mmpo.vlm.fsdp.full_weights`` gathers every unit for
  ``generate`` beside its shards (the policy, or INPO's frozen pi_t in ``ref_dtype``).

Activations per token and layer follow Korthikanti et al. 2022 (arXiv 2205.05198, sec. 4.1), redone
for a Qwen2 decoder layer (RMSNorm, grouped-query attention with a memory-efficient kernel, so no
sequence x sequence term, SwiGLU MLP, no dropout); the tensors autograd keeps, in elements:
norm output (h), q, k, v (h + 2 h_kv), rotary inputs and outputs of q and k (2 (h + h_kv)),
attention output (h), the residual stream (h), MLP norm output (h), gate, up, silu(gate),
silu(gate) * up (4 i): about 7 h + 4 h_kv + 4 i (more below in :func:`layer_activation_bytes`).
"""

from __future__ import annotations

import dataclasses

import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Published dimensions of the Qwen2.5-VL checkpoints (their config.json on the hub), so that a budget
# can be printed for a real-size config whose checkpoint is not on this machine.
_QWEN25_VL_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                         spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                         fullatt_block_indexes=[7, 15, 23, 31])
_QWEN25_VL_ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}
KNOWN_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-3b": dict(
        text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                         num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=128000, rope_parameters=_QWEN25_VL_ROPE),
        vision_config=dict(_QWEN25_VL_VISION, out_hidden_size=2048), tie_word_embeddings=True),
    "qwen2.5-vl-7b": dict(
        text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                         max_position_embeddings=128000, rope_parameters=_QWEN25_VL_ROPE),
        vision_config=dict(_QWEN25_VL_VISION, out_hidden_size=3584), tie_word_embeddings=False),
}
# Published dimensions of text-only checkpoints (their config.json on the hub): config class name and fields.
TEXT_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-7b-instruct": ("Qwen2Config", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=32768, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3-8b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}
# max_pixels of the checkpoints' image processor (preprocessor_config.json of Qwen2.5-VL-3B/7B-Instruct):
# the budget's image size when neither the config nor a saved processor caps it (16,384 merged tokens)
QWEN25_VL_MAX_PIXELS = 12845056
# checkpoint directory names -> architecture, for real-size configs whose model_path is not local
_ARCHITECTURE_BY_NAME = {"qwen2.5-vl-3b-instruct": "qwen2.5-vl-3b", "qwen2.5-vl-7b-instruct": "qwen2.5-vl-7b",
                         "qwen2.5-7b-instruct": "qwen2.5-7b-instruct", "qwen3-8b": "qwen3-8b"}


ALL_ARCHITECTURES = (*KNOWN_ARCHITECTURES, *TEXT_ARCHITECTURES)


@dataclass(frozen=True)
class ModelDims:
    """What the budget needs to know about a VLM, read from its config (and a meta-device instance)."""

    num_params: int
    vision_params: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vision_hidden_size: int
    vision_intermediate_size: int
    vision_depth: int
    vision_heads: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    # (module name, in_features, out_features) of every Linear layer, for LoRA adapter sizes
    linears: tuple[tuple[str, int, int], ...] = field(repr=False, default=())
    vision_prefix: str = "model.visual"
    text_only: bool = False  # a text LM (no vision tower: its vision fields are 0 and no image is counted)


def qwen2_5_vl_config(architecture: str) -> Any:
    """The config with the published dimensions of ``architecture``: a ``Qwen2_5_VLConfig`` (see
    ``KNOWN_ARCHITECTURES``) or a text LM's (``TEXT_ARCHITECTURES``: ``Qwen2Config``, ``Qwen3Config``)."""
    import transformers
    from transformers import Qwen2_5_VLConfig

    if architecture in TEXT_ARCHITECTURES:
        class_name, fields = TEXT_ARCHITECTURES[architecture]
        return getattr(transformers, class_name)(**fields)
    if architecture not in KNOWN_ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {sorted(ALL_ARCHITECTURES)}")
    return Qwen2_5_VLConfig(**KNOWN_ARCHITECTURES[architecture])


def architecture_named_by(config_path: str | Path) -> str | None:
    """The known architecture a config file's name names (``*_qwen2_5_vl_7b.yaml`` -> ``qwen2.5-vl-7b``), or None.

    The real-size configs are named after the base model they start from; one whose ``model_path`` is a
    local fine-tune of it (StepGRPO 7B: a Mulberry-style SFT of Qwen2.5-VL-7B) has that model's dimensions."""
    found = re.search(r"qwen2[._]5[-_]vl[-_](\d+b)", Path(config_path).stem.lower())
    name = f"qwen2.5-vl-{found.group(1)}" if found else None
    return name if name in KNOWN_ARCHITECTURES else None


def resolve_model_dims(model_path: str | None, architecture: str | None = None,
                       config_path: str | Path | None = None) -> tuple[ModelDims, str]:
    """``(dims, where they came from)``: ``architecture`` if given, else ``model_path``'s config.json,
    else the known architecture its directory name denotes (e.g. ``.../Qwen2.5-VL-3B-Instruct``), else the
    base model the config file's name names (:func:`architecture_named_by`)."""
    from transformers import AutoConfig

    if architecture is not None:
        return architecture_dims(architecture), f"{architecture} (published dimensions)"
    if model_path and (Path(model_path) / "config.json").is_file():
        return model_dims(AutoConfig.from_pretrained(model_path)), f"{model_path}/config.json"
    name = Path(model_path or "").name.lower()
    if name in _ARCHITECTURE_BY_NAME:
        arch = _ARCHITECTURE_BY_NAME[name]
        return architecture_dims(arch), f"{arch} (published dimensions; no checkpoint at {model_path})"
    named = architecture_named_by(config_path) if config_path is not None else None
    if named is not None:
        return architecture_dims(named), (f"{named} (published dimensions: the base model the config's name "
                                          f"{Path(config_path).name} names; no checkpoint at {model_path})")
    raise FileNotFoundError(
        f"no config.json in {model_path!r} and neither it nor the config's name names a known architecture: pass "
        f"--arch ({', '.join(sorted(ALL_ARCHITECTURES))}) or --set model.init_args.model_path=A_LOCAL_MODEL_DIR"
    )


@functools.lru_cache(maxsize=None)
def architecture_dims(architecture: str) -> ModelDims:
    """:func:`model_dims` of a known architecture (cached: a meta instance of a 7B model takes seconds)."""
    return model_dims(qwen2_5_vl_config(architecture))


def model_dims(config: Any) -> ModelDims:
    """Exact parameter counts and Linear shapes of the model ``config`` describes (meta device: no memory).
    A text LM's config (:func:`mmpo.vlm.factory.model_kind`) gives a :class:`ModelDims` without a vision tower."""
    from mmpo.vlm.factory import _model_class, model_kind

    if model_kind(config) == "text":
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        linears = tuple((name, m.in_features, m.out_features) for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear))
        return ModelDims(
            num_params=sum(p.numel() for p in model.parameters()), vision_params=0, vocab_size=config.vocab_size,
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, vision_hidden_size=0, vision_intermediate_size=0,
            vision_depth=0, vision_heads=0, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
            linears=linears, vision_prefix="", text_only=True)
    with torch.device("meta"):
        model = _model_class(config.model_type)._from_config(config)
    from mmpo.vlm.factory import vision_tower_prefixes

    (vision_prefix,) = vision_tower_prefixes(model)
    num_params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    vision_params = sum(p.numel() for n, p in model.named_parameters() if n.startswith(vision_prefix + "."))
    linears = tuple((name, m.in_features, m.out_features) for name, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear))
    text, vision = config.text_config, config.vision_config
    return ModelDims(
        num_params=num_params, vision_params=vision_params, vocab_size=text.vocab_size,
        hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
        num_layers=text.num_hidden_layers, num_heads=text.num_attention_heads,
        num_kv_heads=text.num_key_value_heads, vision_hidden_size=vision.hidden_size,
        vision_intermediate_size=vision.intermediate_size, vision_depth=vision.depth,
        vision_heads=vision.num_heads, patch_size=vision.patch_size,
        spatial_merge_size=vision.spatial_merge_size, temporal_patch_size=vision.temporal_patch_size,
        linears=linears, vision_prefix=vision_prefix,
    )


@dataclass(frozen=True)
class RunShape:
    """The settings of a run that decide its memory (read from a config by ``mmpo.vlm.estimate_cli``)."""

    micro_batch: int  # completions per forward/backward
    prompt_tokens: int  # per prompt, image tokens included
    completion_tokens: int  # max_new_tokens
    image_pixels: int  # pixels of the one image per prompt (max_pixels); 0 = text only
    generation_sequences: int  # sequences sampled at once per device (prompts per device x G)
    dtype: str = "float32"  # weights (and gradients and AdamW states)
    compute_dtype: str = "float32"  # activations: bfloat16 under bf16-mixed / bf16-true
    gradient_checkpointing: bool = False
    logprob_chunk: int = 1024
    beta: float = 0.0
    ref_dtype: str | None = None  # None = dtype
    ref_offload: bool = False
    # frozen copies of the whole policy kept beside it (in ref_dtype); None = the KL reference rule: one when
    # beta > 0 without LoRA (LoRA's reference is the adapter-disabled model), else none
    frozen_policy_copies: int | None = None
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    freeze_vision_tower: bool = False
    devices: int = 1
    sharded: bool = False  # FSDP / FSDP2: weights, gradients, optimizer states and reference split over devices
    generates: bool = True  # RL (rollouts); False for SFT
    accumulates: bool = False  # several micro-batches per optimizer step (gradients live during forwards)
    # distinct prompts in one micro-batch: GRPO's training forward runs each distinct prompt (and its image)
    # once and indexes its KV cache out to its completions (mmpo.vlm.shared_prompts); None = one per completion
    prompts_per_micro_batch: int | None = None
    # distinct prompts per generation call: the HF engine prefills each prompt once and copies its KV cache
    # to its G samples (mmpo.vlm.rollout, prefill_once); None = one prefill per sequence
    generation_prompts: int | None = None
    # the model that samples is one of the frozen copies (INPO's pi_t, in ref_dtype), not the policy
    samples_from_frozen_copy: bool = False
    # PPO's value model (mmpo.algos.ppo): a second backbone of the policy's size in ``dtype``; "trained" adds its
    # gradients, AdamW states (full, or its LoRA adapters of ``critic_lora_rank``) and a second micro-batch
    # forward / backward of activations; "frozen" (DVPO) only its weights and its no-grad forward
    critic: str | None = None
    critic_lora_rank: int = 0


def trained_params(dims: ModelDims, run: RunShape) -> int:
    """Parameters that get gradients and AdamW states: the LoRA adapters, or the weights (minus a frozen tower)."""
    if run.lora_rank:
        excluded = dims.vision_prefix + "." if run.freeze_vision_tower else None
        return sum(run.lora_rank * (fan_in + fan_out) for name, fan_in, fan_out in dims.linears
                   if name.rsplit(".", 1)[-1] in run.lora_targets and not (excluded and name.startswith(excluded)))
    return dims.num_params - (dims.vision_params if run.freeze_vision_tower else 0)


def layer_activation_bytes(hidden: int, kv_hidden: int, intermediate: int, compute_bytes: int) -> int:
    """Bytes autograd keeps per token for one decoder layer (no checkpointing).

    7 h + 4 h_kv + 4 i elements in the compute dtype (module docstring), plus, when that dtype is
    16-bit, the float32 copies HF's RMSNorm makes of its input for the variance (2 norms x h x 4 B).
    """
    elements = 7 * hidden + 4 * kv_hidden + 4 * intermediate
    upcast = 2 * hidden * 4 if compute_bytes < 4 else 0
    return elements * compute_bytes + upcast


def frozen_policy_copies(run: RunShape) -> int:
    """Whole-model frozen copies beside the policy: the module's own count, else the KL reference rule."""
    if run.frozen_policy_copies is not None:
        return run.frozen_policy_copies
    return 1 if run.beta > 0 and not run.lora_rank else 0


def estimate_memory(dims: ModelDims, run: RunShape) -> dict[str, float]:
    """Per-device bytes of each part (see the module docstring) and the peaks of the two phases.

    Keys: weights, gradients, optimizer, reference, autocast_cache, activations,
    activations_no_checkpointing, activations_checkpointing, logprob_chunk, kv_cache, generation_logits,
    prefill, gathered_weights, steady, peak_training, peak_generation, peak_reference, peak.
    """
    w = DTYPE_BYTES[run.dtype]
    c = DTYPE_BYTES[run.compute_dtype]
    shard = run.devices if run.sharded else 1
    trained = trained_params(dims, run)
    out: dict[str, float] = {}
    out["weights"] = dims.num_params * w / shard + (trained * w if run.lora_rank else 0)
    out["gradients"] = trained * w / (1 if run.lora_rank else shard)
    out["optimizer"] = 2 * trained * w / (1 if run.lora_rank else shard)
    ref_bytes = frozen_policy_copies(run) * dims.num_params * DTYPE_BYTES[run.ref_dtype or run.dtype] / shard
    out["reference"] = 0.0 if run.ref_offload else ref_bytes
    # PPO's value model: its weights, and when trained its gradients and AdamW states
    critic_trained = (trained_params(dims, dataclasses.replace(run, lora_rank=run.critic_lora_rank))
                      if run.critic == "trained" else 0)
    critic_adapters = critic_trained * w if run.critic_lora_rank else 0
    critic_split = 1 if run.critic_lora_rank else shard
    out["critic"] = ((dims.num_params * w / shard + critic_adapters + 3 * critic_trained * w / critic_split)
                     if run.critic else 0.0)
    # autocast keeps a bf16 copy of each float32 weight a forward uses (whole, even when sharded:
    # FSDP gathers a layer before its forward) until the forward ends
    out["autocast_cache"] = dims.num_params * 2 if (c < w) else 0.0

    # ---- training: one micro-batch of completions, each with its prompt and image
    prompts = run.micro_batch if run.prompts_per_micro_batch is None else run.prompts_per_micro_batch
    tokens = prompts * run.prompt_tokens + run.micro_batch * run.completion_tokens
    h, i = dims.hidden_size, dims.intermediate_size
    kv = dims.num_kv_heads * (h // dims.num_heads)
    per_layer = layer_activation_bytes(h, kv, i, c)
    # a shared prompt's keys and values are copied out to each of its completions, in every layer
    shared_kv = (run.micro_batch * run.prompt_tokens * 2 * kv * c * dims.num_layers
                 if run.prompts_per_micro_batch is not None else 0)
    patches = run.image_pixels // (dims.patch_size**2)
    vision_tokens = prompts * patches
    vision_layer = layer_activation_bytes(dims.vision_hidden_size, dims.vision_hidden_size,
                                          dims.vision_intermediate_size, c)
    # pixel values (float32: 3 x temporal 2 x 14 x 14 per patch) and the patch embedding
    vision_input = vision_tokens * (3 * dims.temporal_patch_size * dims.patch_size**2 * 4
                                    + dims.vision_hidden_size * c)
    # outside the layers: embeddings, final norm and the hidden states the log-prob head reads
    outside = tokens * 3 * h * c
    full = tokens * per_layer * dims.num_layers + vision_tokens * vision_layer * dims.vision_depth
    # checkpointing keeps each layer's input and recomputes one layer at a time in backward
    checkpointed = (tokens * h * c * dims.num_layers + vision_tokens * dims.vision_hidden_size * c * dims.vision_depth
                    + max(tokens * per_layer, vision_tokens * vision_layer))
    out["activations_no_checkpointing"] = full + vision_input + outside + shared_kv
    out["activations_checkpointing"] = checkpointed + vision_input + outside + shared_kv
    out["activations"] = out["activations_checkpointing" if run.gradient_checkpointing else
                             "activations_no_checkpointing"]
    if run.critic == "trained":  # the value model's forward / backward runs in the same micro-batch
        out["activations"] *= 2
    # the log-prob head: one chunk's float32 logits, their exp and their gradient (mmpo.core.logprobs)
    chunk_rows = min(run.logprob_chunk, run.micro_batch * run.completion_tokens)
    out["logprob_chunk"] = 3 * chunk_rows * dims.vocab_size * 4

    # ---- generation: KV cache of every sequence at full length, last-position logits, prefill
    head_dim = h // dims.num_heads
    length = run.prompt_tokens + run.completion_tokens
    n = run.generation_sequences if run.generates else 0
    out["kv_cache"] = 2 * dims.num_layers * dims.num_kv_heads * head_dim * length * n * c
    out["generation_logits"] = n * dims.vocab_size * 4 * 2  # logits, then the float32 softmax of sampling
    # prefill: no autograd, the widest transient is one MLP's gate, up and product over the prompts
    prefilled = n if run.generation_prompts is None or not run.generates else run.generation_prompts
    out["prefill"] = prefilled * run.prompt_tokens * (2 * h + 3 * i) * c
    # sharded: generate runs on the sampling model's gathered full weights, allocated beside its shards
    sampler = (run.ref_dtype or run.dtype) if run.samples_from_frozen_copy else run.dtype
    out["gathered_weights"] = dims.num_params * DTYPE_BYTES[sampler] if run.sharded and run.generates else 0.0

    steady = out["weights"] + out["gradients"] + out["optimizer"] + out["reference"] + out["critic"]
    out["steady"] = steady
    # Gradients are dropped (set to None) before each optimizer step's first forward and allocated in
    # backward as activations are released: without accumulation the larger of the two is live at
    # once; with it, later micro-batches run their forward with the earlier ones' gradients in place.
    gradients_and_activations = (out["gradients"] + out["activations"] if run.accumulates
                                 else max(out["gradients"], out["activations"]))
    out["peak_training"] = (steady - out["gradients"] + out["autocast_cache"] + gradients_and_activations
                            + out["logprob_chunk"])
    out["peak_generation"] = (steady + out["autocast_cache"] + out["kv_cache"] + out["generation_logits"]
                              + out["prefill"] + out["gathered_weights"]) if run.generates else 0.0
    # reference log-prob pass (no grad): an offloaded reference is on the device for it
    ref_pass_tokens = run.micro_batch * (run.prompt_tokens + run.completion_tokens)
    out["peak_reference"] = (steady + (ref_bytes if run.ref_offload else 0.0)
                             + ref_pass_tokens * (2 * h + 3 * i) * c + out["logprob_chunk"]) if ref_bytes > 0 or run.beta > 0 else 0.0
    out["peak"] = max(out["peak_training"], out["peak_generation"], out["peak_reference"])
    return out


def format_budget(budget: Mapping[str, float], dims: ModelDims, run: RunShape, *, header: str) -> str:
    """The table ``mmpo estimate`` prints (GB = 1e9 bytes; MB = 1e6 for budgets under 1 GB)."""
    scale, unit = (GB, "GB") if budget["peak"] >= GB else (1e6, "MB")

    def gb(x: float) -> str:
        return f"{x / scale:10.2f}"

    trained = trained_params(dims, run)
    strategy = f"sharded over {run.devices}" if run.sharded else ("replicated" if run.devices > 1 else "one device")
    copies = frozen_policy_copies(run)
    if run.frozen_policy_copies is not None:  # the module's own frozen models (DPO: none, INPO: pi_ref and pi_t)
        ref = f"{copies} frozen {run.ref_dtype or run.dtype} cop{'y' if copies == 1 else 'ies'} (the module's)"
    else:
        ref = ("none (beta 0)" if run.beta == 0 else "the adapter-disabled policy (no copy)" if run.lora_rank else
               f"{run.ref_dtype or run.dtype} copy" + (", offloaded to CPU between passes" if run.ref_offload else ""))
    lines = [
        header,
        f"  parameters: {dims.num_params / 1e9:.3f} B (vision tower {dims.vision_params / 1e9:.3f} B), "
        f"trained: {trained / 1e9:.4f} B" + (f" (LoRA rank {run.lora_rank})" if run.lora_rank else ""),
        f"  {run.devices} device(s), {strategy}; weights {run.dtype}, compute {run.compute_dtype}; "
        f"KL reference: {ref}",
        f"  micro-batch {run.micro_batch} completions x ({run.prompt_tokens} prompt + {run.completion_tokens} "
        f"completion tokens), {run.image_pixels} pixels per image; "
        + (f"{run.generation_sequences} sequences generated at once" if run.generates else "no generation"),
        "",
        f"  per device                          {unit}",
        f"  weights                    {gb(budget['weights'])}",
        f"  gradients                  {gb(budget['gradients'])}",
        f"  optimizer (AdamW, 2 states){gb(budget['optimizer'])}",
        f"  reference                  {gb(budget['reference'])}",
        *([f"  value model ({run.critic})" + " " * (15 - len(run.critic)) + gb(budget["critic"])] if run.critic else []),
        f"  = steady state             {gb(budget['steady'])}",
        f"  autocast bf16 weight cache {gb(budget['autocast_cache'])}",
        f"  activations, checkpointing {gb(budget['activations_checkpointing'])}"
        + ("  <- configured" if run.gradient_checkpointing else ""),
        f"  activations, none          {gb(budget['activations_no_checkpointing'])}"
        + ("" if run.gradient_checkpointing else "  <- configured"),
        f"  log-prob chunk             {gb(budget['logprob_chunk'])}",
        f"  generation KV cache        {gb(budget['kv_cache'])}",
        f"  generation logits + prefill{gb(budget['generation_logits'] + budget['prefill'])}",
        f"  full weights for generation{gb(budget['gathered_weights'])}"
        + ("  (sharded: gathered for generate)" if budget["gathered_weights"] else ""),
        "",
        f"  peak, training micro-batch {gb(budget['peak_training'])}",
        f"  peak, generation           {gb(budget['peak_generation'])}",
        f"  peak, reference pass       {gb(budget['peak_reference'])}",
        f"  peak                       {gb(budget['peak'])}",
    ]
    return "\n".join(lines)


def peak_gb(budget: Mapping[str, float]) -> int:
    """The peak rounded up to whole GB, as quoted in the real-size configs' comments."""
    return math.ceil(budget["peak"] / GB)
