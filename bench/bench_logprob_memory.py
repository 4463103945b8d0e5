"""Peak memory and time: chunked ``token_log_probs_from_hidden`` vs naive logits + log_softmax.

Each (path, phase) runs in its own subprocess so its peak RSS (``ru_maxrss``) is its own;
the reported peak is the kernel's peak RSS during the run (VmHWM, reset once the inputs exist;
``ru_maxrss`` where VmHWM cannot be reset) minus the RSS with the inputs in memory
(tracemalloc does not see torch's allocator). Both paths see the same seeded inputs; the
parent checks that log-probs and gradients agree.

Phases:
- ``fwd``: log-probs under ``torch.no_grad()`` (old / reference log-probs of a rollout).
- ``fwd_bwd``: log-probs, then backward of a weighted sum into hidden states and lm_head.

Usage (defaults: Qwen2.5-0.5B head, V=151936, H=896, B=4, T=1024, fp32 CPU)::

    OMP_NUM_THREADS=1 python bench/bench_logprob_memory.py [--out bench/results/core_raw.md]
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

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.batch, args.time, args.hidden, generator=gen)
    weight = torch.randn(args.vocab, args.hidden, generator=gen)
    weight.mul_(args.hidden**-0.5)  # in place: a temporary copy would inflate the baseline high-water mark
    tokens = torch.randint(0, args.vocab, (args.batch, args.time), generator=gen)
    loss_weights = torch.randn(args.batch, args.time, generator=gen)
    probe_rows = torch.randint(0, args.vocab, (256,), generator=gen)
    train = args.phase == "fwd_bwd"
    hidden.requires_grad_(train)
    weight.requires_grad_(train)
    method = _reset_peak()
    baseline = _status_mb("VmRSS") if method == "VmHWM" else _maxrss_mb()

    start = time.perf_counter()
    with torch.set_grad_enabled(train):
        if args.path == "naive":
            logits = hidden @ weight.t()
            log_probs = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        else:
            log_probs = token_log_probs_from_hidden(hidden, weight, tokens, chunk_size=args.chunk_size)
        if train:
            (log_probs * loss_weights).sum().backward()
    seconds = time.perf_counter() - start
    peak = _status_mb("VmHWM") if method == "VmHWM" else _maxrss_mb()

    result = {"log_probs": log_probs.detach()}
    if train:
        result["grad_hidden"] = hidden.grad
        result["grad_weight_rows"] = weight.grad[probe_rows]
    torch.save(result, args.result_file)
    print(json.dumps({"seconds": seconds, "baseline_mb": baseline, "peak_mb": peak, "delta_mb": peak - baseline,
                      "method": method}))


def _run_child(script: Path, args: argparse.Namespace, path: str, phase: str, result_file: str) -> dict:
    cmd = [
        sys.executable, str(script), "--child", "--path", path, "--phase", phase, "--result-file", result_file,
        "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--batch", str(args.batch),
        "--time", str(args.time), "--chunk-size", str(args.chunk_size), "--threads", str(args.threads),
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
        f"V={args.vocab}, H={args.hidden}, B={args.batch}, T={args.time}, fp32 CPU, "
        f"{args.threads} thread(s), chunk_size={args.chunk_size}; one (B,T,V) fp32 tensor = {full_tensor_mb:.0f} MiB",
        "",
        "| phase | path | peak RSS over inputs (MiB) | time (s) | memory ratio naive/chunked | time ratio chunked/naive |",
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
                print(f"{phase} {path}: {runs[path]['delta_mb']:.0f} MiB, {runs[path]['seconds']:.1f} s", flush=True)
            naive, chunked = runs["naive"], runs["chunked"]
            for key, ref in naive["result"].items():
                err = (chunked["result"][key] - ref).abs().max().item()
                tol = 1e-4 * max(1.0, ref.abs().max().item())
                all_equal &= err <= tol
                notes.append(f"- {phase} {key}: max abs diff {err:.2e} (tolerance {tol:.1e})")
                print(notes[-1], flush=True)
            mem_ratio = naive["delta_mb"] / max(chunked["delta_mb"], 1.0)
            time_ratio = chunked["seconds"] / naive["seconds"]
            notes.append(f"- {phase}: peak measured with {naive['method']} (naive) / {chunked['method']} (chunked); "
                         f"baseline RSS with inputs {naive['baseline_mb']:.0f} / {chunked['baseline_mb']:.0f} MiB")
            lines.append(f"| {phase} | naive | {naive['delta_mb']:.0f} | {naive['seconds']:.1f} | | |")
            lines.append(
                f"| {phase} | chunked | {chunked['delta_mb']:.0f} | {chunked['seconds']:.1f} | "
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
