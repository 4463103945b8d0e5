"""Peak memory and time: chunked ``token_log_probs_from_hidden`` vs naive logits + log_softmax.

Each (path, phase) runs in its own subprocess, so each peak belongs to that path alone.
On CPU the reported peak is the kernel's peak RSS during the run (VmHWM, reset once the
inputs exist; ``ru_maxrss`` where VmHWM cannot be reset) minus the RSS with the inputs in
memory (tracemalloc does not see torch's allocator). On CUDA it is
``torch.cuda.max_memory_allocated`` after a warm-up, minus the memory the inputs take. Both
paths see the same seeded inputs; the parent checks that log-probs and gradients agree.

Phases:
- ``fwd``: log-probs under ``torch.no_grad()`` (old / reference log-probs of a rollout).
- ``fwd_bwd``: log-probs, then backward of a weighted sum into hidden states and lm_head.

Usage (defaults: Qwen2.5-0.5B head, V=151936, H=896, B=4, T=1024, fp32 CPU)::

    OMP_NUM_THREADS=1 python bench/bench_logprob_memory.py [--out table.md]
    python bench/bench_logprob_memory.py --device cuda --dtype bfloat16 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _maxrss_mb() -> float:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return float(line.split()[1]) / 1024.0
    raise KeyError(field)


def _reset_peak() -> str:
    """Reset the kernel's peak-RSS mark (VmHWM) so it starts from the current RSS.

    ``ru_maxrss`` cannot be reset: input set-up may leave it above the current RSS, which would
    hide part of the measured path's peak. Writing 5 to /proc/self/clear_refs resets VmHWM
    (Linux >= 4.0); fall back to ru_maxrss where that is not allowed.
    """
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return "VmHWM"
    except OSError:
        return "ru_maxrss"


def _child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from mmpo.core import token_log_probs_from_hidden

    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.batch, args.time, args.hidden, generator=gen).to(device, dtype)
    weight = torch.randn(args.vocab, args.hidden, generator=gen)
    weight.mul_(args.hidden**-0.5)  # in place: a temporary copy would inflate the baseline high-water mark
    weight = weight.to(device, dtype)
    tokens = torch.randint(0, args.vocab, (args.batch, args.time), generator=gen).to(device)
    loss_weights = torch.randn(args.batch, args.time, generator=gen).to(device)
    probe_rows = torch.randint(0, args.vocab, (256,), generator=gen).to(device)
    train = args.phase == "fwd_bwd"
    hidden.requires_grad_(train)
    weight.requires_grad_(train)

    def run_path():
        with torch.set_grad_enabled(train):
            if args.path == "naive":
                # the usual recipe: full logits, upcast, log_softmax, gather
                logits = (hidden @ weight.t()).float()
                log_probs = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            else:
                log_probs = token_log_probs_from_hidden(hidden, weight, tokens, chunk_size=args.chunk_size)
            if train:
                (log_probs * loss_weights).sum().backward()
        return log_probs

    if device.type == "cuda":
        run_path()  # warm-up: kernels, cuBLAS workspaces
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        method = "cuda.max_memory_allocated"
        baseline = torch.cuda.memory_allocated() / 2**20
    else:
        method = _reset_peak()
        baseline = _status_mb("VmRSS") if method == "VmHWM" else _maxrss_mb()

    timings = []
    for _ in range(args.repeats):
        hidden.grad = weight.grad = None
        start = time.perf_counter()
        log_probs = run_path()
        if device.type == "cuda":
            torch.cuda.synchronize()
        timings.append(time.perf_counter() - start)
    seconds = sorted(timings)[len(timings) // 2]  # median
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = _status_mb("VmHWM") if method == "VmHWM" else _maxrss_mb()

    result = {"log_probs": log_probs.detach().float().cpu()}
    if train:
        result["grad_hidden"] = hidden.grad.float().cpu()
        result["grad_weight_rows"] = weight.grad[probe_rows].float().cpu()
    torch.save(result, args.result_file)
    print(json.dumps({"seconds": seconds, "baseline_mb": baseline, "peak_mb": peak, "delta_mb": peak - baseline,
                      "method": method}))


def _run_child(script: Path, args: argparse.Namespace, path: str, phase: str, result_file: str) -> dict:
    cmd = [
        sys.executable, str(script), "--child", "--path", path, "--phase", phase, "--result-file", result_file,
        "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--batch", str(args.batch),
        "--time", str(args.time), "--chunk-size", str(args.chunk_size), "--threads", str(args.threads),
        "--device", args.device, "--dtype", args.dtype, "--repeats", str(args.repeats),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--time", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=256, help="rows per chunk of the chunked path")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--phases", default="fwd,fwd_bwd")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda: peak = torch.cuda.max_memory_allocated)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per path (median reported)")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=["fwd", "fwd_bwd"], help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return 0

    import torch

    script = Path(__file__).resolve()
    full_tensor_mb = args.batch * args.time * args.vocab * 4 / 2**20
    lines = [
        f"V={args.vocab}, H={args.hidden}, B={args.batch}, T={args.time}, {args.dtype} on {args.device}, "
        f"{args.threads} CPU thread(s), chunk_size={args.chunk_size}; one (B,T,V) fp32 tensor = {full_tensor_mb:.0f} MiB",
        "",
        f"| phase | path | peak {'GPU memory' if args.device.startswith('cuda') else 'RSS'} over inputs (MiB) | time (ms, median of {args.repeats}) | memory ratio naive/chunked | time ratio chunked/naive |",
        "|---|---|---|---|---|---|",
    ]
    notes = []
    all_equal = True
    with tempfile.TemporaryDirectory() as tmp:
        for phase in args.phases.split(","):
            runs = {}
            for path in ("naive", "chunked"):
                result_file = os.path.join(tmp, f"{phase}_{path}.pt")
                runs[path] = _run_child(script, args, path, phase, result_file)
                runs[path]["result"] = torch.load(result_file, weights_only=True)
                print(f"{phase} {path}: {runs[path]['delta_mb']:.0f} MiB, {runs[path]['seconds'] * 1e3:.1f} ms", flush=True)
            naive, chunked = runs["naive"], runs["chunked"]
            for key, ref in naive["result"].items():
                err = (chunked["result"][key] - ref).abs().max().item()
                # bf16 inputs: both paths round differently inside the matmul, so compare loosely
                rel = 1e-4 if args.dtype == "float32" else 2e-2
                tol = rel * max(1.0, ref.abs().max().item())
                all_equal &= err <= tol
                notes.append(f"- {phase} {key}: max abs diff {err:.2e} (tolerance {tol:.1e})")
                print(notes[-1], flush=True)
            mem_ratio = naive["delta_mb"] / max(chunked["delta_mb"], 1.0)
            time_ratio = chunked["seconds"] / naive["seconds"]
            notes.append(f"- {phase}: peak measured with {naive['method']} (naive) / {chunked['method']} (chunked); "
                         f"baseline memory with inputs {naive['baseline_mb']:.0f} / {chunked['baseline_mb']:.0f} MiB")
            lines.append(f"| {phase} | naive | {naive['delta_mb']:.0f} | {naive['seconds'] * 1e3:.1f} | | |")
            lines.append(
                f"| {phase} | chunked | {chunked['delta_mb']:.0f} | {chunked['seconds'] * 1e3:.1f} | "
                f"{mem_ratio:.1f}x | {time_ratio:.2f}x |"
            )
    lines.extend(["", *notes, "", f"results equal (log-probs, grad hidden, grad lm_head rows): {'yes' if all_equal else 'NO'}"])
    table = "\n".join(lines)
    print()
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")
    return 0 if all_equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
