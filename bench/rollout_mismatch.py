"""How far HF generate's own log-probs (KV cache) are from the trainer's recomputed ones, and the
rollout IS weights that gap gives, on the tiny Qwen2.5-VL in float32 and bfloat16.

    python bench/rollout_mismatch.py [--device cpu|cuda] [--samples 8] [--tokens 32]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from mmpo.algos.grpo import GRPOModule
from mmpo.core import rollout_is_weights
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus, make_items
from mmpo.training.config import LossConfig, SamplingConfig
from mmpo.vlm.factory import build_tiny_vlm
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.rollout import HFGenerateEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    path = build_tiny_vlm(tempfile.mkdtemp(), corpus=[SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)],
                          vocab_size=400, hidden_size=64, intermediate_size=128)
    rows = make_items("count_shapes", 4, seed=0)
    print("| dtype | temperature | tokens | mean abs diff | max abs diff | token_truncate mean w | "
          "sequence_truncate mean w | sequence_mask clipped frac (C=2) |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        module = GRPOModule(str(path), sampling=SamplingConfig(num_generations=args.samples),
                            loss=LossConfig(beta=0.0), dtype=dtype).to(args.device)
        engine = HFGenerateEngine(module.model, module.processor)
        for temperature in (1.0, 0.7):
            torch.manual_seed(0)
            rollout = engine.generate(rows, num_samples=args.samples, max_new_tokens=args.tokens,
                                      temperature=temperature, return_log_probs=True).to(args.device)
            with torch.no_grad():
                trainer, _ = completion_log_probs(module.model, rollout.prompt_inputs, rollout.completion_ids,
                                                  rollout.completion_mask, temperature=temperature)
            engine_lp, mask = rollout.extras["engine_log_probs"], rollout.completion_mask
            _, tok = rollout_is_weights(trainer, engine_lp, mask, "token_truncate")
            _, seq = rollout_is_weights(trainer, engine_lp, mask, "sequence_truncate")
            _, seq_mask = rollout_is_weights(trainer, engine_lp, mask, "sequence_mask")
            print(f"| {dtype} | {temperature} | {int(mask.sum())} | {float(tok['rollout_is/logp_diff_mean']):.1e} | "
                  f"{float(tok['rollout_is/logp_diff_max']):.1e} | {float(tok['rollout_is/mean']):.4f} | "
                  f"{float(seq['rollout_is/mean']):.4f} | {float(seq_mask['rollout_is/clipped_frac']):.3f} |")


if __name__ == "__main__":
    main()
