"""Real-scale check on a GPU: GRPO steps on a random-weight model with Qwen2.5-VL-3B's full dimensions.

The model has Qwen2.5-VL-3B-Instruct's published dimensions (36 text layers of width 2048, a
32-block vision tower, vocabulary 151,936; ``mmpo.vlm.memory.KNOWN_ARCHITECTURES``) and random
weights; the tokenizer and processor are the tiny model's (``build_tiny_vlm``: Qwen's special tokens,
chat template and image processor). Every prompt carries one image of the real pixel budget
(1120 x 896 = 1,003,520 pixels = max_pixels of ``configs/vlm/grpo_qwen2_5_vl_3b.yaml``: 1,280 image
tokens). The run goes through ``GRPOModule`` and a Lightning ``Trainer`` exactly as ``mmpo fit`` does:
float32 master weights under ``precision: bf16-mixed``, the KL reference in bf16 (``ref_dtype``),
gradient checkpointing, the HF ``generate`` rollout engine.

It records, per step, the step time, rollout and update times, generated tokens/s, and the peak
device memory (``torch.cuda.max_memory_allocated``) against ``mmpo estimate``'s budget for the same
shapes, then prints a markdown table for bench/RESULTS.md. Without CUDA it exits with status 2.

    python bench/gpu_check.py                 # one GPU, about 5 minutes on an H200
    python bench/gpu_check.py --steps 2 --prompts 2 --generations 4 --max-new-tokens 128
    python bench/gpu_check.py --strategy <name>   # several GPUs: a Lightning strategy name or class path

``--tiny-cpu`` runs the same pipeline on the CPU with a model of the same vocabulary but tiny widths
(the self-test in tests/e2e/test_gpu_check.py); its memory column is then the
``LiveTensorBytes`` peak (mmpo.training.live_memory).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from mmpo.training.config import LossConfig, OptimConfig, RewardConfig, SamplingConfig

REAL_MAX_PIXELS = 1003520  # 1280 x 28 x 28, the real-size configs' max_pixels
IMAGE_SIZE = (1120, 896)  # width x height: exactly REAL_MAX_PIXELS, sides multiples of 28
# --tiny-cpu: the real vocabulary, everything else tiny
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                         "mrope_section": [2, 3, 3]})
TINY_VISION = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64,
                   fullatt_block_indexes=[0])
TINY_IMAGE_SIZE = (224, 224)


def build_model_dir(out: Path, *, tiny: bool, device: str) -> Path:
    """Write a random-weight Qwen2.5-VL (3B dimensions, or tiny widths) with the tiny tokenizer/processor."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from mmpo.vlm.factory import build_tiny_vlm
    from mmpo.vlm.memory import KNOWN_ARCHITECTURES

    tokenizer_dir = build_tiny_vlm(out / "tokenizer", hidden_size=32, intermediate_size=64,
                                   max_pixels=REAL_MAX_PIXELS)
    tiny_config = Qwen2_5_VLConfig.from_pretrained(tokenizer_dir)
    spec = copy.deepcopy(KNOWN_ARCHITECTURES["qwen2.5-vl-3b"])
    if tiny:
        spec["text_config"].update(TINY_TEXT)
        spec["vision_config"].update(TINY_VISION)
        spec["tie_word_embeddings"] = spec["text_config"]["tie_word_embeddings"] = False
    # the tiny tokenizer's special-token ids (0..6), in a vocabulary of the real size
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        spec[key] = getattr(tiny_config, key)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        spec["text_config"][key] = spec[key] = getattr(tiny_config.text_config, key)
    config = Qwen2_5_VLConfig(**spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = tiny_config.text_config.eos_token_id
    model.generation_config.pad_token_id = tiny_config.text_config.pad_token_id
    model_dir = out / "model"
    model.to(torch.bfloat16).save_pretrained(model_dir)  # bf16 on disk: half the write; loaded as float32
    del model
    from transformers import AutoProcessor

    AutoProcessor.from_pretrained(tokenizer_dir).save_pretrained(model_dir)
    return model_dir


def prompt_rows(n: int, size: tuple[int, int], seed: int) -> list[dict[str, Any]]:
    """Synthetic counting prompts with their image upscaled to ``size`` (the real pixel budget)."""
    from mmpo.data.synthetic import make_items

    rows = make_items("count_shapes", n, seed=seed)
    for row in rows:
        row["images"] = [image.resize(size) for image in row["images"]]
    return rows


class StepTimer(L.Callback):
    """Lightning callback: wall time of each training step (device synchronised) and the module's metrics."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[dict[str, float]] = []
        self._t0 = 0.0

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:  # noqa: ANN001
        self._sync()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self._sync()
        metrics = dict(getattr(module, "last_metrics", {}))
        metrics["step_s"] = time.perf_counter() - self._t0
        if torch.cuda.is_available():
            metrics["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        self.steps.append({k: float(v) for k, v in metrics.items()})


def run(args: argparse.Namespace) -> tuple[list[dict[str, float]], dict[str, float], dict[str, Any]]:
    from torch.utils.data import DataLoader

    from mmpo.algos.grpo import GRPOModule
    from mmpo.training.live_memory import LiveTensorBytes
    from mmpo.vlm.memory import RunShape, estimate_memory, model_dims
    from mmpo.vlm.processing import encode_prompts

    tiny = args.tiny_cpu
    device = "cpu" if tiny else "cuda"
    work = Path(args.workdir or tempfile.mkdtemp(prefix="mmpo_gpu_check_"))
    t_build = time.perf_counter()
    model_dir = build_model_dir(work, tiny=tiny, device=device)
    build_s = time.perf_counter() - t_build
    size = TINY_IMAGE_SIZE if tiny else IMAGE_SIZE
    batches = [prompt_rows(args.prompts, size, seed=step) for step in range(args.steps)]
    rollout = args.prompts * args.generations
    micro = args.micro_batch_size or rollout
    module = GRPOModule(str(model_dir),
                        sampling=SamplingConfig(num_generations=args.generations, max_new_tokens=args.max_new_tokens),
                        loss=LossConfig(beta=0.01), ref_dtype="bfloat16",
                        optim=OptimConfig(lr=1e-6, micro_batch_size=micro), dtype="float32",
                        gradient_checkpointing=True, max_pixels=REAL_MAX_PIXELS,
                        rewards=RewardConfig(timeout_s=None), system_prompt="default", seed=0)
    # the prompt width (image tokens included) the budget is computed for: the first batch's
    prompt_tokens = int(encode_prompts(module.processor, batches[0], system_prompt=module.system_prompt)
                        ["input_ids"].shape[1])
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu" if tiny else "gpu", devices=1 if tiny else args.devices, strategy=args.strategy,
        precision="32-true" if tiny else "bf16-mixed", max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
    )
    loader = DataLoader(batches, batch_size=None, collate_fn=lambda rows: rows)
    if tiny:
        existing = [*module.model.parameters(), *module.model.buffers(), *module.reference_model.parameters()]
        with LiveTensorBytes(existing) as live:
            trainer.fit(module, loader)
        measured_gib = live.peak / 2**30
    else:
        torch.cuda.reset_peak_memory_stats()
        trainer.fit(module, loader)
        measured_gib = torch.cuda.max_memory_allocated() / 2**30

    from transformers import AutoConfig

    shape = RunShape(
        micro_batch=micro, prompt_tokens=prompt_tokens, completion_tokens=args.max_new_tokens,
        image_pixels=size[0] * size[1], generation_sequences=rollout, dtype="float32",
        compute_dtype="float32" if tiny else "bfloat16", gradient_checkpointing=True, beta=0.01,
        ref_dtype="bfloat16", devices=trainer.world_size, sharded=_sharded(args.strategy) and trainer.world_size > 1,
        accumulates=micro < rollout,
    )
    budget = estimate_memory(model_dims(AutoConfig.from_pretrained(model_dir)), shape)
    info = {"build_s": build_s, "prompt_tokens": prompt_tokens, "measured_peak_gib": measured_gib,
            "world_size": trainer.world_size, "model_dir": str(model_dir)}
    return timer.steps, budget, info


def _sharded(strategy: str) -> bool:
    from mmpo.vlm.estimate_cli import _is_sharded

    return _is_sharded(strategy)


def markdown(args: argparse.Namespace, steps: list[dict[str, float]], budget: dict[str, float],
             info: dict[str, Any]) -> str:
    gib = 2**30
    device = "CPU (--tiny-cpu)" if args.tiny_cpu else torch.cuda.get_device_name(0)
    lines = [
        f"- Machine: {device} x {info['world_size']}, torch {torch.__version__}, python {platform.python_version()}",
        f"- Model: random weights, {'tiny widths' if args.tiny_cpu else 'Qwen2.5-VL-3B dimensions'}, vocabulary "
        f"151,936; {args.prompts} prompts x G {args.generations} per step, {args.max_new_tokens} new tokens, "
        f"prompt {info['prompt_tokens']} tokens (one image per prompt), micro-batch "
        f"{args.micro_batch_size or args.prompts * args.generations}; float32 weights, "
        f"{'fp32' if args.tiny_cpu else 'bf16-mixed'}, gradient checkpointing, beta 0.01 (reference in bf16), "
        f"HF generate; strategy {args.strategy}.",
        f"- Model build + save: {info['build_s']:.0f} s.",
        "",
        "| step | step (s) | rollout (s) | update (s) | completion tokens | generated tokens/s | peak so far (GiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, m in enumerate(steps, 1):
        tokens = m.get("response/length_mean", 0.0) * args.prompts * args.generations
        peak = f"{m['peak_gib']:.1f}" if "peak_gib" in m else "-"
        lines.append(f"| {i} | {m['step_s']:.1f} | {m.get('perf/rollout_s', 0):.1f} | {m.get('perf/update_s', 0):.1f} "
                     f"| {tokens:.0f} | {m.get('perf/tokens_per_s', 0):.0f} | {peak} |")
    measured = info["measured_peak_gib"]
    estimate = budget["peak"] / gib
    lines += [
        "",
        "| memory | GiB |",
        "|---|---|",
        f"| measured peak ({'LiveTensorBytes' if args.tiny_cpu else 'torch.cuda.max_memory_allocated'}) "
        f"| {measured:.2f} |",
        f"| mmpo estimate: peak | {estimate:.2f} |",
        f"| mmpo estimate: training / generation / reference pass | {budget['peak_training'] / gib:.2f} / "
        f"{budget['peak_generation'] / gib:.2f} / {budget['peak_reference'] / gib:.2f} |",
        f"| estimate / measured | {estimate / measured:.2f} |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps (the first includes warm-up)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--generations", type=int, default=5, help="G, completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="completions per forward/backward")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="auto", help="Lightning strategy (name or class path)")
    parser.add_argument("--workdir", default=None, help="where the random model is written (default: a temp dir)")
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    parser.add_argument("--tiny-cpu", action="store_true", help="self-test: tiny widths on the CPU")
    args = parser.parse_args(argv)
    if not args.tiny_cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); this check needs a GPU. "
              "Nothing was run. (--tiny-cpu runs the same pipeline at tiny widths on the CPU.)", file=sys.stderr)
        return 2
    steps, budget, info = run(args)
    table = markdown(args, steps, budget, info)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
