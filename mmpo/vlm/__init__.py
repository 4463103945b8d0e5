"""Vision-language models for mmpo: loading, processing, rollouts and log-probs.

- :mod:`mmpo.vlm.factory`: ``load_vlm`` (real Qwen2/2.5/3-VL checkpoints via ``from_pretrained``),
  ``build_tiny_vlm`` (a tiny Qwen2.5-VL with a locally trained tokenizer), ``save_vlm``,
  ``make_reference_model``.
- :mod:`mmpo.vlm.processing`: ``encode_prompts`` (qwen-vl-utils images, left padding, image
  token checks naming the row), ``encode_completions``, ``select_rows`` / ``repeat_rows``.
- :mod:`mmpo.vlm.rollout`: ``HFGenerateEngine(model, processor).generate(...) -> Rollout``.
- :mod:`mmpo.vlm.logprobs`: ``completion_log_probs`` (chunked, never builds B x T x V logits).

Submodules import transformers; import them directly (``from mmpo.vlm.factory import load_vlm``).
"""
