"""Policy models: load a real checkpoint, or build a tiny Qwen2.5-VL or Qwen3 text LM locally.

Both paths end in ``from_pretrained``: ``build_tiny_vlm`` writes a real
Qwen2.5-VL directory (config, safetensors weights, tokenizer, processor) and
``load_vlm`` reads it exactly as it would read ``Qwen/Qwen2.5-VL-3B-Instruct``.
Qwen2.5-VL: arXiv 2502.13923. Qwen2-VL: arXiv 2409.12191.

Text-only causal LMs (Qwen2.5, Qwen3, Llama, ...) go through the same ``load_vlm``: the model kind is
read from the checkpoint's config (:func:`model_kind`: a config without a ``vision_config`` is a text
LM), the model is loaded with ``AutoModelForCausalLM`` and its tokenizer is wrapped in
:class:`TextProcessor`, which answers the processor calls the pipeline makes (``.tokenizer``, chat
template, ``batch_decode``, ``save_pretrained``). ``build_tiny_text_lm`` writes a tiny Qwen3.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Sequence

import torch

# Qwen's special tokens, in the order the tiny tokenizer assigns them ids 0..6.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2-VL's own chat template (from the Qwen2-VL-*-Instruct tokenizer_config.json), so
# that prompts rendered for the tiny model look exactly like the real model's prompts.
QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The special tokens of the tiny text LM (ids 0..2): a text Qwen tokenizer's end-of-text and ChatML markers.
QWEN_TEXT_SPECIAL_TOKENS = QWEN_SPECIAL_TOKENS[:3]

# Qwen2.5-Instruct's chat template for plain string messages (its tokenizer_config.json, tool branches
# left out): a default system turn when the conversation has none, ChatML turns, the assistant header.
QWEN_TEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Pixel budget for the synthetic images (a 112 x 112 image -> 4 x 4 merged tokens).
TINY_MIN_PIXELS = 28 * 28 * 4
TINY_MAX_PIXELS = 28 * 28 * 16

# model_type -> transformers class name; anything else goes through AutoModelForImageTextToText.
_MODEL_CLASSES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}


def _model_class(model_type: str):
    import transformers

    name = _MODEL_CLASSES.get(model_type)
    if name is not None and hasattr(transformers, name):
        return getattr(transformers, name)
    return transformers.AutoModelForImageTextToText


MODEL_KINDS = ("vlm", "text")


def model_kind(config: Any) -> str:
    """``"vlm"`` or ``"text"``, from a transformers config (or its ``config.json`` as a dict).

    A config with a ``vision_config`` (Qwen2/2.5/3-VL and every HF image-text model) is a VLM; one
    without it whose ``architectures`` name a ``...ForCausalLM`` (or that names none) is a text LM
    (Qwen2.5, Qwen3, Llama, ...). Anything else (a vision-only or encoder config) raises ValueError.
    """
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    if get("vision_config") is not None:
        return "vlm"
    architectures = list(get("architectures") or [])
    if not architectures or any(name.endswith("ForCausalLM") for name in architectures):
        return "text"
    raise ValueError(f"model_type {get('model_type')!r} (architectures {architectures}) is neither a "
                     "vision-language model (no vision_config) nor a causal LM (no ...ForCausalLM)")


class TextProcessor:
    """A text LM's tokenizer in the role of a VLM processor: the one object the pipeline passes around.

    ``.tokenizer`` is the tokenizer; calling it tokenizes chat-rendered text (``images`` must be empty;
    no special tokens are added: the chat template already wrote them, e.g. Llama's BOS);
    ``apply_chat_template``, ``batch_decode``, ``decode`` and ``save_pretrained`` are the tokenizer's.
    """

    is_text_only = True

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:  # Llama has none: pad with EOS (always masked out)
            tokenizer.pad_token = tokenizer.eos_token
        self.chat_template = tokenizer.chat_template

    def __call__(self, text: Sequence[str], images: Any = None, **kwargs: Any):
        if images:
            raise ValueError("a text-only model's processor got images")
        kwargs.setdefault("add_special_tokens", False)
        return self.tokenizer(list(text), **kwargs)

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def batch_decode(self, *args: Any, **kwargs: Any) -> list[str]:
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode(*args, **kwargs)

    def save_pretrained(self, directory: str | Path, **kwargs: Any) -> Any:
        return self.tokenizer.save_pretrained(directory, **kwargs)

    def __repr__(self) -> str:
        return f"TextProcessor({type(self.tokenizer).__name__}, vocab {len(self.tokenizer)})"


def is_text_processor(processor: Any) -> bool:
    """True for the processor of a text-only LM (:class:`TextProcessor`)."""
    return bool(getattr(processor, "is_text_only", False))


def turn_end_token_id(tokenizer: Any) -> int:
    """The token that ends an assistant turn: ChatML's ``<|im_end|>`` (Qwen), Llama 3's ``<|eot_id|>``,
    else the tokenizer's EOS."""
    vocab = tokenizer.get_vocab()
    for token in ("<|im_end|>", "<|eot_id|>"):
        if token in vocab:
            return int(vocab[token])
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{type(tokenizer).__name__} has no <|im_end|>, <|eot_id|> or EOS token to end a turn")
    return int(tokenizer.eos_token_id)


def load_model(path: str | Path, **kwargs: Any) -> tuple[torch.nn.Module, Any]:
    """:func:`load_vlm` under the name that says it loads both kinds."""
    return load_vlm(path, **kwargs)


def load_vlm(
    path: str | Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
) -> tuple[torch.nn.Module, Any]:
    """Load a saved VLM or text LM and its processor with ``from_pretrained``.

    The kind comes from the checkpoint's config (:func:`model_kind`): a VLM loads its
    ``...ForConditionalGeneration`` class and ``AutoProcessor``; a text LM loads through
    ``AutoModelForCausalLM`` with its tokenizer (and chat template) as a :class:`TextProcessor`.

    Args:
        path: a local HF directory (a real Qwen2/2.5/3-VL or Qwen2.5/Qwen3/Llama checkpoint, or one
            written by :func:`build_tiny_vlm` / :func:`build_tiny_text_lm`).
        dtype: weights dtype (``torch.float32`` on CPU, ``torch.bfloat16`` on GPU).
        min_pixels, max_pixels: override the image processor's pixel budget (each image is
            resized so that H*W lies in [min_pixels, max_pixels], sides multiples of 28). A text LM
            has no image processor: setting either raises ValueError.
        trust_remote_code: only when the user asks for it.
        attn_implementation: e.g. ``"sdpa"`` or ``"flash_attention_2"``; None = transformers' default.

    Returns:
        ``(model, processor)``; the model is in eval mode, ``processor.tokenizer.padding_side == "left"``.
    """
    from transformers import AutoConfig, AutoProcessor

    if not str(path).strip():  # Path("") is the current directory: name the real mistake
        raise ValueError(f"model path is empty ({str(path)!r}): give a saved HF model directory")
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"load_vlm: no config.json in {path} (expected a saved HF model directory)")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    kind = model_kind(config)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if kind == "text":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if min_pixels is not None or max_pixels is not None:
            raise ValueError(f"{path} is a text-only LM ({config.model_type}): min_pixels / max_pixels do not apply")
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        model.eval()
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if not tokenizer.chat_template:
            raise ValueError(f"{path}: the tokenizer has no chat template (prompts are rendered with it)")
        processor = TextProcessor(tokenizer)
        tokenizer.padding_side = "left"
        return model, processor
    model_cls = _model_class(config.model_type)
    model = model_cls.from_pretrained(path, **kwargs)
    model.eval()

    processor_kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    processor = AutoProcessor.from_pretrained(path, **processor_kwargs)
    set_pixel_budget(processor, min_pixels=min_pixels, max_pixels=max_pixels)
    # Generation needs left padding so every prompt ends right where sampling starts.
    processor.tokenizer.padding_side = "left"
    return model, processor


def set_pixel_budget(processor: Any, *, min_pixels: int | None, max_pixels: int | None) -> None:
    """Set the image processor's [min_pixels, max_pixels] (stored as size shortest/longest edge)."""
    image_processor = processor.image_processor
    size = dict(image_processor.size)
    if min_pixels is not None:
        size["shortest_edge"] = int(min_pixels)
    if max_pixels is not None:
        size["longest_edge"] = int(max_pixels)
    if size.get("shortest_edge") and size.get("longest_edge") and size["shortest_edge"] > size["longest_edge"]:
        raise ValueError(f"min_pixels ({size['shortest_edge']}) > max_pixels ({size['longest_edge']})")
    image_processor.size = type(image_processor.size)(**size) if not isinstance(image_processor.size, dict) else size
    for attr, key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if hasattr(image_processor, attr) and key in size:
            setattr(image_processor, attr, size[key])


def pixel_budget(processor: Any) -> tuple[int, int]:
    """``(min_pixels, max_pixels)`` currently used by the processor's image processor."""
    if is_text_processor(processor):
        raise ValueError("a text-only LM has no image processor (no pixel budget)")
    size = processor.image_processor.size
    get = size.get if isinstance(size, dict) else (lambda k: getattr(size, k, None))
    return int(get("shortest_edge")), int(get("longest_edge"))


def _save_initialised(model_class: Any, config: Any, ids: dict[str, int], *, seed: int, output_dir: Path,
                      processor: Any) -> None:
    """A seeded random initialisation of ``model_class(config)`` with the ChatML end / pad / begin tokens as its
    generation config, saved with its processor (or tokenizer): the last step of both tiny builders."""
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.bos_token_id = ids["<|endoftext|>"]
    model.save_pretrained(output_dir)
    processor.save_pretrained(output_dir)


def default_corpus() -> list[str]:
    """Text the tiny tokenizer is trained on: synthetic prompts and solutions (``mmpo.data``).

    Imported lazily: ``mmpo.data`` is only needed when no corpus is passed.
    """
    from mmpo.data import SYSTEM_PROMPT
    from mmpo.data.synthetic import (AGENT_TASKS, DIALOGUE_TASKS, TASKS, TESTBED_TASKS, TEXT_TASKS, TEXT_TEACHER_TASKS,
                                     corpus)

    # the text-LM, tool, dialogue and testbed tasks run on the text LM (default_text_corpus) or have their own images
    # (zoom); leaving them out keeps the tiny VLM's tokenizer, and so every recorded tiny-VLM run, as it was
    # before they existed
    later = {*TEXT_TASKS, *TEXT_TEACHER_TASKS, *AGENT_TASKS, *DIALOGUE_TASKS, *TESTBED_TASKS}
    return [SYSTEM_PROMPT, *corpus([task for task in TASKS if task not in later])]


def _train_tokenizer(corpus: Sequence[str], vocab_size: int, *,
                     special_tokens: Sequence[str] = QWEN_SPECIAL_TOKENS, chat_template: str = QWEN_VL_CHAT_TEMPLATE,
                     individual_digits: bool = False):
    """Byte-level BPE trained locally (no hub): ``special_tokens`` (Qwen's) get ids 0, 1, ...

    ``individual_digits``: every digit is its own pre-token (``tokenizers``' ``Digits(individual_digits=True)``
    before the byte-level split, as Qwen2's pre-tokenizer regex splits ``\\p{N}`` one at a time), so no merge
    joins digits and a number is the same digit tokens wherever it appears (``4821`` is ``4 8 2 1`` after
    ``Compute``, after a quote and alone)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                               if individual_digits else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # the chat template's own words, so prompts tokenize compactly whatever the corpus
    template_text = ["system\nYou are a helpful assistant.", "user\n", "assistant\n"]
    tokenizer.train_from_iterator([*template_text, *corpus], trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(special_tokens[1:]),
        padding_side="left",
        chat_template=chat_template,
    )
    return wrapped


def build_tiny_vlm(
    output_dir: str | Path,
    *,
    seed: int = 0,
    corpus: Sequence[str] | None = None,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    vision_hidden_size: int = 64,
    vision_depth: int = 1,
    vision_heads: int = 4,
    vision_intermediate_size: int = 128,
    min_pixels: int = TINY_MIN_PIXELS,
    max_pixels: int = TINY_MAX_PIXELS,
    max_position_embeddings: int = 2048,
) -> Path:
    """Build, save and return the directory of a tiny randomly initialised Qwen2.5-VL.

    The model is a real ``Qwen2_5_VLForConditionalGeneration`` (a ``Qwen2_5_VLConfig`` with
    ``num_layers`` text layers and a ``vision_depth``-block vision tower, patch 14, spatial
    merge 2), the tokenizer a byte-level BPE trained on ``corpus`` with Qwen's special tokens
    and chat template, the processor a real ``Qwen2_5_VLProcessor``. Everything is written
    with ``save_pretrained`` so :func:`load_vlm` reads it through ``from_pretrained``.

    Args:
        output_dir: directory to write (created).
        seed: seeds the weight initialisation.
        corpus: texts for the tokenizer; default: ``mmpo.data.corpus``.
        **size: the model sizes above; head_dim = hidden_size / num_heads must be even.
    """
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
    )

    if hidden_size % num_heads or (hidden_size // num_heads) % 2:
        raise ValueError(f"hidden_size {hidden_size} / num_heads {num_heads} must be an even integer head_dim")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if vision_hidden_size % vision_heads or (vision_hidden_size // vision_heads) % 4:
        # the vision rotary embedding splits head_dim/2 into (h, w) halves
        raise ValueError(f"vision head_dim {vision_hidden_size}/{vision_heads} must be a multiple of 4")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    corpus = list(corpus) if corpus is not None else default_corpus()
    if not corpus:
        raise ValueError("build_tiny_vlm: empty tokenizer corpus")

    tokenizer = _train_tokenizer(corpus, vocab_size)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_SPECIAL_TOKENS}
    image_processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
    processor = Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=_tiny_video_processor(min_pixels, max_pixels),
        chat_template=QWEN_VL_CHAT_TEMPLATE,
    )

    head_dim = hidden_size // num_heads
    # mRoPE splits head_dim/2 rotary frequencies into (temporal, height, width) sections,
    # in Qwen's 16:24:24 proportions (the real 3B/7B models use [16, 24, 24] of 64).
    half = head_dim // 2
    temporal = max(1, round(half * 16 / 64))
    spatial = (half - temporal) // 2
    mrope_section = [temporal, spatial, half - temporal - spatial]
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_position_embeddings,
            max_window_layers=num_layers,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=vision_depth,
            hidden_size=vision_hidden_size,
            intermediate_size=vision_intermediate_size,
            num_heads=vision_heads,
            out_hidden_size=hidden_size,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=list(range(vision_depth)),
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    _save_initialised(Qwen2_5_VLForConditionalGeneration, config, ids, seed=seed, output_dir=output_dir,
                      processor=processor)
    (output_dir / "mmpo_tiny.json").write_text(
        json.dumps(
            {
                "seed": seed,
                "vocab_size": len(tokenizer),
                "hidden_size": hidden_size,
                "num_layers": num_layers,
                "vision_depth": vision_depth,
                "min_pixels": min_pixels,
                "max_pixels": max_pixels,
            },
            indent=2,
        )
    )
    return output_dir


def default_text_corpus() -> list[str]:
    """Text the tiny text LM's tokenizer is trained on: the system prompts, and the text tasks' problems and
    solutions (``mmpo.data.synthetic.TEXT_TASKS``)."""
    from mmpo.data import SYSTEM_PROMPT
    from mmpo.data.synthetic import TEXT_TASKS, corpus

    return [SYSTEM_PROMPT, *corpus(list(TEXT_TASKS))]


TOOL_PROMPT_REPEATS = 20
"""Copies of the tool system prompt in :func:`tool_task_corpus` (so BPE merges its words as it does the tasks')."""


def tool_task_corpus(task: str, tools: Sequence[str], n: int = 200, *, vlm: bool = False) -> list[str]:
    """:func:`default_text_corpus` (``vlm``: the tiny VLM's :func:`default_corpus`) plus what a tool-use run on
    ``task`` shows the model: the system prompt with ``tools`` advertised (as ``mmpo.algos.agent`` renders it,
    :data:`TOOL_PROMPT_REPEATS` times), and ``n`` training rows' problems and ``tool_trace`` messages (their text;
    a tool's image answer has none). A tokenizer trained on it writes the tool-use context in fewer tokens (the
    codebook task: 305 instead of 700 for a whole trace, 212 instead of 549 for the system prompt; zoom_digit's
    call: 42 tokens instead of 81, each box coordinate one token), so SFT and RL steps on CPU are cheaper."""
    from mmpo.data import SYSTEM_PROMPT
    from mmpo.data.synthetic import make_items
    from mmpo.tools.functions import load_tools, tool_system_prompt

    system = tool_system_prompt(SYSTEM_PROMPT, [tool.schema for tool in load_tools(list(tools))])
    rows = make_items(task, n, seed=0, split="train")
    texts = [message["content"] for row in rows for message in row.get("tool_trace", [])
             if isinstance(message["content"], str)]
    base = default_corpus() if vlm else default_text_corpus()
    return [*base, *[system] * TOOL_PROMPT_REPEATS, *[row["problem"] for row in rows], *texts]


def build_tiny_text_lm(
    output_dir: str | Path,
    *,
    seed: int = 0,
    corpus: Sequence[str] | None = None,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 2048,
    individual_digits: bool = False,
) -> Path:
    """Build, save and return the directory of a tiny randomly initialised Qwen3 text LM.

    The model is a real ``Qwen3ForCausalLM`` (a ``Qwen3Config`` with ``num_layers`` layers, grouped-query
    attention with q/k norms), the tokenizer a byte-level BPE trained on ``corpus`` with the ChatML special
    tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) and Qwen2.5-Instruct's chat template
    (:data:`QWEN_TEXT_CHAT_TEMPLATE`). Written with ``save_pretrained``; :func:`load_vlm` reads it back as a
    text LM (:func:`model_kind`).

    Args:
        output_dir: directory to write (created).
        seed: seeds the weight initialisation.
        corpus: texts for the tokenizer; default: :func:`default_text_corpus`.
        individual_digits: one token per digit everywhere (:func:`_train_tokenizer`; the ``calc`` task's tool
            tokenizer, so the prompt's numbers, the calculator call's and the result's are the same digit tokens).
        **size: the model sizes above; head_dim = hidden_size / num_heads must be even.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if hidden_size % num_heads or (hidden_size // num_heads) % 2:
        raise ValueError(f"hidden_size {hidden_size} / num_heads {num_heads} must be an even integer head_dim")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    corpus = list(corpus) if corpus is not None else default_text_corpus()
    if not corpus:
        raise ValueError("build_tiny_text_lm: empty tokenizer corpus")
    tokenizer = _train_tokenizer(corpus, vocab_size, special_tokens=QWEN_TEXT_SPECIAL_TOKENS,
                                 chat_template=QWEN_TEXT_CHAT_TEMPLATE, individual_digits=individual_digits)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_TEXT_SPECIAL_TOKENS}
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        max_window_layers=num_layers,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    _save_initialised(Qwen3ForCausalLM, config, ids, seed=seed, output_dir=output_dir, processor=tokenizer)
    (output_dir / "mmpo_tiny.json").write_text(
        json.dumps({"kind": "text", "seed": seed, "vocab_size": len(tokenizer), "hidden_size": hidden_size,
                    "num_layers": num_layers, "individual_digits": individual_digits}, indent=2)
    )
    return output_dir


def build_tiny_reward_model(
    output_dir: str | Path,
    *,
    seed: int = 0,
    corpus: Sequence[str] | None = None,
    vocab_size: int = 400,
    hidden_size: int = 32,
    num_layers: int = 1,
    num_labels: int = 1,
) -> Path:
    """Build, save and return a tiny randomly initialised reward model: a ``Qwen3ForSequenceClassification``
    (``num_labels`` logits read at the last non-pad token) with the tiny text LM's tokenizer and chat template
    (:func:`build_tiny_text_lm`), loadable with ``AutoModelForSequenceClassification`` (``mmpo.rewards.models``)."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    corpus = list(corpus) if corpus is not None else default_text_corpus()
    tokenizer = _train_tokenizer(corpus, vocab_size, special_tokens=QWEN_TEXT_SPECIAL_TOKENS,
                                 chat_template=QWEN_TEXT_CHAT_TEMPLATE)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_TEXT_SPECIAL_TOKENS}
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=hidden_size // 2,
        max_position_embeddings=2048, max_window_layers=num_layers,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        num_labels=num_labels,
    )
    torch.manual_seed(seed)
    Qwen3ForSequenceClassification(config).save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def _tiny_video_processor(min_pixels: int, max_pixels: int):
    """Qwen2-VL's video processor (the processor class requires one; videos are not used here)."""
    from transformers import Qwen2VLVideoProcessor

    return Qwen2VLVideoProcessor(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})


def make_reference_model(
    model: torch.nn.Module, beta: float, *, dtype: torch.dtype | None = None
) -> torch.nn.Module | None:
    """Frozen copy of ``model`` for the KL term, in ``dtype`` (None = the model's own); ``None`` when
    ``beta == 0`` (no KL, no memory).

    The copy is cast tensor by tensor as it is made, so a bfloat16 reference of a float32 policy never
    exists as a second float32 copy, not even for a moment.
    """
    if beta == 0:
        return None
    if dtype is None:
        reference = copy.deepcopy(model)
    else:
        # deepcopy's memo maps each parameter / buffer to its replacement: the copy gets the cast
        # tensors directly (floating ones only: integer buffers keep their dtype)
        memo: dict[int, Any] = {}
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                cast = tensor.detach().to(dtype)
                memo[id(tensor)] = torch.nn.Parameter(cast, requires_grad=False) if isinstance(
                    tensor, torch.nn.Parameter) else cast
        reference = copy.deepcopy(model, memo)
    reference.eval()
    reference.requires_grad_(False)
    return reference


def vision_tower_prefixes(model: torch.nn.Module) -> list[str]:
    """Module names of the vision tower(s) of an HF VLM (Qwen2/2.5/3-VL: ``model.visual``).

    Raises ``ValueError`` when the model has none, so ``freeze_vision_tower`` never silently freezes nothing.
    """
    names = [name for name, _ in model.named_modules()
             if name.rsplit(".", 1)[-1] in ("visual", "vision_tower", "vision_model")]
    outermost = [n for n in names if not any(n.startswith(other + ".") for other in names if other != n)]
    if not outermost:
        raise ValueError(f"{type(model).__name__} has no vision tower (a module named visual, vision_tower or "
                         "vision_model): freeze_vision_tower cannot apply")
    return outermost


def save_vlm(model: torch.nn.Module, processor: Any, output_dir: str | Path,
             state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write model (safetensors) and processor so :func:`load_vlm` can read them back.

    A LoRA model (``mmpo.training.lora``) is written as merged weights, loadable without peft,
    with its adapter alone in ``output_dir / "adapter"``. ``state_dict``: the weights to write instead
    of ``model``'s own (the gathered full weights of an FSDP2-sharded model,
    :func:`mmpo.vlm.fsdp.full_state_dict`, keyed like the transformers model; for LoRA the adapter
    tensors included).
    """
    from mmpo.training.lora import is_lora, save_merged_and_adapter

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if is_lora(model):
        save_merged_and_adapter(model, output_dir, state_dict)
    else:
        model.save_pretrained(output_dir, safe_serialization=True, state_dict=state_dict)
    processor.save_pretrained(output_dir)
    return output_dir
