"""Issue 13's lever "static KV cache + torch.compile of the decoding step", measured on the tiny Qwen2.5-VL.

One rollout = 2 prompts x G 8 completions forced to ``--tokens`` new tokens (the GRPO-vs-TRL benchmark's
batch), through mmpo's ``HFGenerateEngine``. Three decoders, each run in its own one-thread subprocess,
interleaved A B C | C B A ... per round; per run the median wall / CPU seconds per rollout after 2 warm-up
rollouts (the first pays the compilation):

- ``eager``: today's engine (one prefill per prompt, DynamicCache, eager forward).
- ``static_compile``: the same prefill, its cache copied into a ``StaticCache`` (prompt + new tokens long),
  then HF ``generate`` with a ``CompileConfig`` (inductor, forced on CPU with ``_compile_all_devices``).
- ``hf_static_compile``: HF's own path (``num_return_sequences``, ``cache_implementation="static"``) compiled.

    python bench/bench_decode_compile.py --tokens 128 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("eager", "static_compile", "hf_static_compile")


def run(model_dir: str, mode: str, tokens: int, rollouts: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from transformers import CompileConfig, StaticCache

    from mmpo.data.synthetic import make_items
    from mmpo.vlm.factory import load_vlm
    from mmpo.vlm.rollout import HFGenerateEngine

    model, processor = load_vlm(model_dir)
    model.generation_config.min_new_tokens = tokens
    engine = HFGenerateEngine(model, processor, prefill_once=mode != "hf_static_compile")
    if mode != "eager":
        compile_config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
        compile_config._compile_all_devices = True  # HF compiles on CUDA/XPU only unless told
        model.generation_config.compile_config = compile_config
    if mode == "hf_static_compile":
        model.generation_config.cache_implementation = "static"
    if mode == "static_compile":
        prefill = engine._prefill

        def static_prefill(inputs, copies, special):
            out = prefill(inputs, copies, special)
            static = StaticCache(config=model.config, max_cache_len=out["input_ids"].shape[1] + tokens)
            for index, layer in enumerate(out["cache"].layers):
                static.update(layer.keys, layer.values, index)
            return {**out, "cache": static}

        engine._prefill = static_prefill
    rows = make_items("count_shapes", 2 * rollouts, seed=0)
    wall, cpu = [], []
    for i in range(rollouts):
        torch.manual_seed(i)
        start, start_cpu = time.perf_counter(), time.process_time()
        rollout = engine.generate(rows[2 * i: 2 * i + 2], num_samples=8, max_new_tokens=tokens)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        assert int(rollout.completion_mask.sum()) == 16 * tokens  # forced full length on every side
    return {"mode": mode, "first_wall_s": wall[0], "wall_s": statistics.median(wall[2:]),
            "cpu_s": statistics.median(cpu[2:])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--worker", choices=MODES)
    parser.add_argument("--model")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run(args.model, args.worker, args.tokens, args.rollouts)))
        return 0
    from mmpo.vlm.factory import build_tiny_vlm

    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_vlm(Path(tmp) / "tiny", seed=0))
        for round_index in range(args.rounds):
            order = MODES if round_index % 2 == 0 else MODES[::-1]
            for mode in order:
                done = subprocess.run([sys.executable, __file__, "--worker", mode, "--model", model_dir,
                                       "--tokens", str(args.tokens), "--rollouts", str(args.rollouts)],
                                      capture_output=True, text=True, check=True,
                                      env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
                result = json.loads(done.stdout.strip().splitlines()[-1])
                results[mode].append(result)
                print(json.dumps({"round": round_index, **result}), flush=True)
    eager = statistics.median(r["cpu_s"] for r in results["eager"])
    print(f"\n| decoder ({args.tokens} tokens, 16 rows) | s / rollout (wall) | CPU-s / rollout | vs eager (CPU) | "
          "first rollout wall s |\n|---|---|---|---|---|")
    for mode in MODES:
        wall = statistics.median(r["wall_s"] for r in results[mode])
        cpu = statistics.median(r["cpu_s"] for r in results[mode])
        first = statistics.median(r["first_wall_s"] for r in results[mode])
        print(f"| {mode} | {wall:.3f} | {cpu:.3f} | {cpu / eager:.2f}x | {first:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
