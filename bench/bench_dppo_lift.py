"""Benchmark: does DPPO lift a mediocre BC diffusion policy on robosuite Lift (or Can)? (arXiv 2409.00588)

Pipeline per seed: noisy scripted demos -> BC (DDPM eps-MSE, EMA 0.995) -> deterministic eval
-> DPPO fine-tuning for a fixed env-step budget -> deterministic eval with the fine-tuned
network (same chain as training). Plus simulator throughput: one raw env vs the subprocess
vector env (``mmpo.robotics.envs.measure_steps_per_s``) and the DPPO rollout's env steps/s (policy
sampling included), all measured in the same run. Prints a markdown block of the results.

The paper's budget (50 envs x 300 chunk steps x 81 iterations, ~4.9M env steps, 3000+ BC epochs)
does not fit a CPU; every budget knob is a command-line option:

    python bench/bench_dppo_lift.py --seeds 0 1 2 --dppo-env-steps 20000 --num-envs 8 --eval-episodes 50

``--task can`` runs the same pipeline on robosuite PickPlaceCan (23-D state): dims from the task registry
(mmpo/robotics/envs/tasks.py), the Can scripted expert's demos, and the Can defaults of mmpo.robotics.bench.TASK_DEFAULTS for the options
left unset (the default task, lift, keeps every default it had).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import lightning.pytorch as pl  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from mmpo.eval.stats import mean_std  # noqa: E402
from mmpo.files import atomic_write_json  # noqa: E402
from mmpo.robotics.bench import (  # noqa: E402
    build_parser,
    default_demos,
    check_demos,
    dppo_module,
    evaluate,
    finish_args,
    fit_rl,
    task_spec,
    train_diffusion_bc,
)


class RolloutRate(pl.Callback):
    """Collects DPPO's per-iteration metrics."""

    def __init__(self) -> None:
        self.history: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.history.append(dict(module.last_metrics))
        m = module.last_metrics
        print(f"  dppo itr {len(self.history)}: train success {m.get('charts/success_rate', float('nan')):.3f} "
              f"return {m.get('charts/return', float('nan')):.2f} clipfrac {m.get('policy/clipfrac', 0):.3f} "
              f"kl {m.get('policy/approx_kl', 0):.2e} env steps/s {m['perf/env_steps_per_s']:.0f}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return finish_args(build_parser(__doc__.split("\n\n")[0]).parse_args(argv))


def run_seed(seed: int, args, demos: Path, out_dir: Path) -> dict[str, float]:
    from mmpo.robotics.policy.io import load_policy

    seed_dir = out_dir / f"seed{seed}"
    bc_ckpt, bc_seconds = train_diffusion_bc(seed, args, demos, seed_dir)
    policy, metadata = load_policy(bc_ckpt)
    print(f"[seed {seed}] BC done in {bc_seconds:.0f}s; evaluating", flush=True)
    bc_eval = evaluate(policy, args, seed, metadata["normalizer_path"])
    print(f"[seed {seed}] BC eval: {json.dumps(bc_eval)}", flush=True)
    bc_stochastic = {"success_rate": float("nan")}
    if args.stochastic_eval_episodes:
        bc_stochastic = evaluate(policy, args, seed, metadata["normalizer_path"], deterministic=False,
                                 episodes=args.stochastic_eval_episodes)
        print(f"[seed {seed}] BC stochastic eval: {json.dumps(bc_stochastic)}", flush=True)

    dppo = dppo_module(bc_ckpt, args, seed)
    rates = RolloutRate()
    _, dppo_seconds = fit_rl(dppo, args, seed_dir, rates, "dppo.ckpt")
    ft_policy, _ = load_policy(seed_dir / "dppo.ckpt")
    dppo_eval = evaluate(ft_policy, args, seed, metadata["normalizer_path"])
    print(f"[seed {seed}] DPPO eval: {json.dumps(dppo_eval)}", flush=True)
    dppo_stochastic = {"success_rate": float("nan")}
    if args.stochastic_eval_episodes:
        dppo_stochastic = evaluate(ft_policy, args, seed, metadata["normalizer_path"], deterministic=False,
                                   episodes=args.stochastic_eval_episodes)
        print(f"[seed {seed}] DPPO stochastic eval: {json.dumps(dppo_stochastic)}", flush=True)
    env_steps = sum(h["perf/env_steps_total"] for h in rates.history[-1:])
    return {
        "seed": seed,
        "bc_success": bc_eval["success_rate"],
        "bc_return": bc_eval["return"],
        "dppo_success": dppo_eval["success_rate"],
        "dppo_return": dppo_eval["return"],
        "bc_success_stochastic": bc_stochastic["success_rate"],
        "dppo_success_stochastic": dppo_stochastic["success_rate"],
        "dppo_iterations": len(rates.history),
        "dppo_env_steps": env_steps,
        "rollout_env_steps_per_s": float(np.mean([h["perf/env_steps_per_s"] for h in rates.history])),
        "bc_seconds": bc_seconds,
        "dppo_seconds": dppo_seconds,
        "faults": rates.history[-1]["perf/faults"],
        "train_success_first": rates.history[0].get("charts/success_rate", float("nan")),
        "train_success_last": rates.history[-1].get("charts/success_rate", float("nan")),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from mmpo.robotics.demos import generate_demos
    from mmpo.robotics.envs import measure_steps_per_s

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    demos = default_demos(args, out_dir)
    started = time.perf_counter()
    if not demos.exists():
        stats = generate_demos(args.task, args.num_demos, demos, noise=args.noise, seed=1234, keep_failures=False)
    else:
        stats = {"success_rate": float("nan"), "note": "reused"}
    check_demos(demos, args)
    print(f"demos: {demos} expert success {stats['success_rate']}", flush=True)
    if args.demos_only:
        return 0
    throughput = measure_steps_per_s(args.task, args.num_envs, args.throughput_steps, act_steps=4)
    print(f"throughput: {json.dumps(throughput)}", flush=True)
    results = [run_seed(seed, args, demos, out_dir) for seed in args.seeds]
    total = time.perf_counter() - started

    lines = [
        f"### DPPO on robosuite {task_spec(args).sim_name} (bench/bench_dppo_lift.py)",
        "",
        f"- command: `python bench/bench_dppo_lift.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
        f"- machine: {platform.machine()}, {os.cpu_count()} logical CPUs, device {args.device}; total {total / 60:.1f} min",
        f"- demos: {args.num_demos} scripted demos, noise std {args.noise} (scripted-expert success with noise: "
        f"{stats['success_rate']})",
        f"- BC: {args.bc_epochs} epochs, MLP [{args.hidden}]x3, K={args.denoising_steps}; DPPO: K'={args.ft_steps}, "
        f"{args.num_envs} envs x {args.n_steps} chunk steps/iteration, budget {args.dppo_env_steps} env steps, "
        f"episodes {args.max_episode_steps} steps, actor lr {args.actor_lr}, clip {args.clip_base}->{args.clip_final}",
        f"- eval: deterministic ({args.eval_sampler or 'ddpm'} chain), {args.eval_episodes} episodes per seed "
        f"(fine-tuned network on the last K' steps); stochastic (training-time sampling): "
        f"{args.stochastic_eval_episodes or 'not run'} episodes; eval episodes end at the first success",
        "",
        "| seed | BC success | DPPO success | BC success (stochastic) | DPPO success (stochastic) | BC return | DPPO return "
        "| DPPO iters | DPPO env steps | rollout env steps/s | BC s | DPPO s | faults |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['seed']} | {r['bc_success']:.3f} | {r['dppo_success']:.3f} | {r['bc_success_stochastic']:.3f} | "
            f"{r['dppo_success_stochastic']:.3f} | {r['bc_return']:.2f} | "
            f"{r['dppo_return']:.2f} | {r['dppo_iterations']} | {r['dppo_env_steps']:.0f} | "
            f"{r['rollout_env_steps_per_s']:.0f} | {r['bc_seconds']:.0f} | {r['dppo_seconds']:.0f} | {r['faults']:.0f} |"
        )
    lines += [
        "",
        f"- success rate mean ± std over seeds: BC {mean_std([r['bc_success'] for r in results])}, "
        f"DPPO {mean_std([r['dppo_success'] for r in results])}",
        f"- simulator throughput (same run, random actions): raw env {throughput['raw_steps_per_s']:.0f} steps/s, "
        f"vector env ({args.num_envs} subprocesses) {throughput['vector_steps_per_s']:.0f} steps/s "
        f"(x{throughput['speedup']:.2f}); DPPO rollouts incl. policy sampling: "
        f"{np.mean([r['rollout_env_steps_per_s'] for r in results]):.0f} env steps/s",
    ]
    block = "\n".join(lines)
    print("\n" + block)
    (out_dir / "results.md").write_text(block + "\n")
    atomic_write_json(out_dir / "results.json", {"args": vars(args), "throughput": throughput, "seeds": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
