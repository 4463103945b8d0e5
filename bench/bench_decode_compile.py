"""Issue 13's decoding levers on the tiny Qwen2.5-VL: a static KV cache + torch.compile, and the lean loop.

One rollout = 2 prompts x G 8 completions forced to ``--tokens`` new tokens (the GRPO-vs-TRL benchmark's
batch), through mmpo's ``HFGenerateEngine``. The decoders (``--modes``), each run in its own one-thread
subprocess, interleaved A B C | C B A ... per round; per run the median wall / CPU seconds per rollout after
2 warm-up rollouts (the first pays any compilation), and a hash of the first rollout's tokens (from seed 0:
equal hashes = the same tokens):

- ``eager``: one prefill per prompt, then HF ``generate`` decodes (DynamicCache, eager forward;
  ``lean_decode=False``: the engine before the lean loop).
- ``static_compile``: the same prefill, its cache copied into a ``StaticCache`` (prompt + new tokens long),
  then HF ``generate`` with a ``CompileConfig`` (inductor, forced on CPU with ``_compile_all_devices``).
- ``hf_static_compile``: HF's own path (``num_return_sequences``, ``cache_implementation="static"``) compiled.
- ``lean``: the same prefill, then the engine's own loop (``HFGenerateEngine._lean_decode``, today's default).
- ``lean_dynamic_cache``: the lean loop appending to HF's ``DynamicCache`` (``torch.cat`` per step) instead
  of its in-place buffers: what the buffers are worth.

    python bench/bench_decode_compile.py --tokens 128 --rounds 2 --modes eager static_compile hf_static_compile
    python bench/bench_decode_compile.py --tokens 32 128 --rounds 3 --modes eager lean lean_dynamic_cache
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("eager", "static_compile", "hf_static_compile", "lean", "lean_dynamic_cache")


def run(model_dir: str, mode: str, tokens: int, rollouts: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from transformers import CompileConfig, StaticCache

    from mmpo.data.synthetic import make_items
    from mmpo.vlm import rollout as rollout_module
    from mmpo.vlm.factory import load_vlm

    model, processor = load_vlm(model_dir)
    model.generation_config.min_new_tokens = tokens
    lean = mode.startswith("lean")
    engine = rollout_module.HFGenerateEngine(model, processor, prefill_once=mode != "hf_static_compile",
                                             lean_decode=lean)
    if mode == "lean_dynamic_cache":  # the loop appends to HF's cache (expanded to the G rows) instead

        def dynamic_cache(cache, extra, copies):
            cache.batch_repeat_interleave(copies)
            return cache

        rollout_module._GrowingKVCache = dynamic_cache
    if mode in ("static_compile", "hf_static_compile"):
        compile_config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
        compile_config._compile_all_devices = True  # HF compiles on CUDA/XPU only unless told
        model.generation_config.compile_config = compile_config
    if mode == "hf_static_compile":
        model.generation_config.cache_implementation = "static"
    if mode == "static_compile":
        prefill = engine._prefill

        def static_prefill(inputs, copies, special, expand_cache=True):
            out = prefill(inputs, copies, special)  # the cache expanded to the G rows here, then made static
            static = StaticCache(config=model.config, max_cache_len=out["input_ids"].shape[1] + tokens)
            for index, layer in enumerate(out["cache"].layers):
                static.update(layer.keys, layer.values, index)
            static.batch_repeat_interleave = lambda repeats: None  # so the engine's expansion is not repeated
            return {**out, "cache": static}

        engine._prefill = static_prefill
    rows = make_items("count_shapes", 2 * rollouts, seed=0)
    wall, cpu, digest = [], [], ""
    for i in range(rollouts):
        torch.manual_seed(i)
        start, start_cpu = time.perf_counter(), time.process_time()
        rollout = engine.generate(rows[2 * i: 2 * i + 2], num_samples=8, max_new_tokens=tokens)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        assert int(rollout.completion_mask.sum()) == 16 * tokens  # forced full length on every side
        assert (engine.last_decode == "lean") == lean, engine.last_decode
        digest = digest or hashlib.sha256(rollout.completion_ids.numpy().tobytes()).hexdigest()[:12]
    return {"mode": mode, "tokens_sha": digest, "first_wall_s": wall[0], "wall_s": statistics.median(wall[2:]),
            "cpu_s": statistics.median(cpu[2:])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="decoders to compare; eager (the reference of the ratios) is always run")
    parser.add_argument("--worker", choices=MODES)
    parser.add_argument("--model")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run(args.model, args.worker, args.tokens[0], args.rollouts)))
        return 0
    from mmpo.vlm.factory import build_tiny_vlm

    modes = ["eager", *[mode for mode in args.modes if mode != "eager"]]
    print(f"load average {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_vlm(Path(tmp) / "tiny", seed=0))
        for tokens in args.tokens:
            results: dict[str, list[dict]] = {mode: [] for mode in modes}
            for round_index in range(args.rounds):
                for mode in modes if round_index % 2 == 0 else modes[::-1]:
                    done = subprocess.run([sys.executable, __file__, "--worker", mode, "--model", model_dir,
                                           "--tokens", str(tokens), "--rollouts", str(args.rollouts)],
                                          capture_output=True, text=True, check=True,
                                          env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    results[mode].append(result)
                    print(json.dumps({"tokens": tokens, "round": round_index, **result}), flush=True)
            eager = {key: statistics.median(r[key] for r in results["eager"]) for key in ("wall_s", "cpu_s")}
            print(f"\n| decoder ({tokens} tokens, 16 rows) | s / rollout (wall) | CPU-s / rollout | vs eager (wall) | "
                  "vs eager (CPU) | first rollout wall s |\n|---|---|---|---|---|---|")
            for mode in modes:
                wall = statistics.median(r["wall_s"] for r in results[mode])
                cpu = statistics.median(r["cpu_s"] for r in results[mode])
                first = statistics.median(r["first_wall_s"] for r in results[mode])
                print(f"| {mode} | {wall:.3f} | {cpu:.3f} | {wall / eager['wall_s']:.2f}x | {cpu / eager['cpu_s']:.2f}x "
                      f"| {first:.1f} |")
            hashes = {mode: {r["tokens_sha"] for r in results[mode]} for mode in modes}
            print(f"first rollout's tokens by decoder: {hashes}\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
