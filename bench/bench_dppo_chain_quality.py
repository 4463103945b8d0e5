"""Benchmark: does a short DDIM rollout chain keep a BC diffusion policy's success? (issue 19)

DPPO's collection is fastest with ``rollout_ddim_steps: n`` (bench/bench_dppo_throughput.py): the same network
on a strided DDIM (eta = 1) chain of n of its K training timesteps. Faster only helps if the policy still
succeeds, so this measures, per BC checkpoint (one per seed), the success of *training-style* stochastic
rollouts (DPPO's sampling: std floor ``min_sampling_std`` 0.1, noise clip 3) with

- ``ddpm``: the policy's own K-step DDPM chain (what the recorded DPPO runs sample), and
- ``ddim``: the n-step DDIM (eta = 1) chain DPPOModule builds for ``rollout_ddim_steps = n``,

on the same envs and seeds (env i seeded ``--env-seed + i``), so episode (env, ordinal) starts from the same
initial state under both chains and the difference is paired. Also the deterministic evaluation of each chain
(``--deterministic``): DDIM eta = 0 over all K timesteps (the recorded runs' ``--eval-sampler ddim``) vs over
the n strided ones (what a ``rollout_ddim_steps = n`` run evaluates). Intervals over seeds and episodes
come from bench/paired_intervals.py (the DPPO vs Gaussian bench's).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/bench_dppo_chain_quality.py \\
        --bc-checkpoints runs/i19/main/seed{0,1,2}/dppo/bc.ckpt --episodes 100 --ddim-steps 5
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mmpo.eval.stats import summarize_contrast  # noqa: E402
from mmpo.files import atomic_write_json  # noqa: E402

#: the chains compared, and the contrast reported (ddim minus ddpm)
CHAINS = ("ddpm", "ddim")
DDIM_MINUS_DDPM = {"ddim": 1.0, "ddpm": -1.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bc-checkpoints", nargs="+", required=True, help="BC checkpoints, one per seed")
    parser.add_argument("--episodes", type=int, default=100, help="episodes per chain and checkpoint")
    parser.add_argument("--ddim-steps", type=int, default=5)
    parser.add_argument("--num-envs", type=int, default=4, help="in-process envs")
    parser.add_argument("--env-seed", type=int, default=20_000, help="env i is seeded env-seed + i")
    parser.add_argument("--deterministic", action="store_true",
                        help="also the deterministic evaluation of each chain (DDIM eta = 0 over K or n steps)")
    parser.add_argument("--n-boot", type=int, default=10_000)
    parser.add_argument("--out", type=Path, default=None, help="JSON of every episode and the summary")
    return parser.parse_args(argv)


def chain_policy(bc_checkpoint: str, chain: str, ddim_steps: int):
    """The policy DPPOModule fine-tunes: the BC policy's own chain, or the DDIM chain of ``rollout_ddim_steps``."""
    from mmpo.robotics.dppo import DPPOModule

    chain_settings = {"rollout_ddim_steps": ddim_steps, "ft_steps": ddim_steps} if chain == "ddim" else {}
    module = DPPOModule(bc_checkpoint, env={"num_envs": 1}, evaluation={"every": 0}, chain=chain_settings)
    return module, module.policy


def episodes_of(bc_checkpoint: str, chain: str, args: argparse.Namespace, deterministic: bool) -> list[dict]:
    from mmpo.robotics.envs import make_vector_env
    from mmpo.robotics.evaluate import evaluate_policy

    module, policy = chain_policy(bc_checkpoint, chain, args.ddim_steps)
    envs = make_vector_env(module.task, args.num_envs, seed=args.env_seed, act_steps=module.act_steps,
                           normalizer_path=module.normalizer_path, max_episode_steps=module.max_episode_steps,
                           asynchronous=False)
    records: list[dict] = []
    try:
        with torch.no_grad():
            evaluate_policy(policy, envs, args.episodes, deterministic=deterministic, seed=args.env_seed,
                            min_sampling_std=module.chain.min_sampling_std, noise_clip=module.chain.noise_clip,
                            deterministic_sampler="ddim" if deterministic and chain == "ddpm" else None, generator=torch.Generator().manual_seed(args.env_seed),
                            episode_records=records, progress=True)
    finally:
        envs.close()
    return records


def paired_arrays(runs: dict[str, list[dict]]) -> dict[str, np.ndarray]:
    """Per chain, the 0/1 successes over the (env, ordinal) episodes both chains recorded, in one order."""
    maps = {chain: {(e["env"], e["ordinal"]): float(e["success"]) for e in episodes} for chain, episodes in runs.items()}
    keys = sorted(set.intersection(*(set(m) for m in maps.values())))
    return {chain: np.array([maps[chain][key] for key in keys]) for chain in maps}


def summary_lines(mode: str, per_seed: list[dict[str, np.ndarray]], n_boot: int) -> list[str]:
    contrast = summarize_contrast(per_seed, DDIM_MINUS_DDPM, n_boot=n_boot)
    rates = {chain: [float(arrays[chain].mean()) for arrays in per_seed] for chain in CHAINS}
    low, high = contrast["bootstrap"]
    elow, ehigh = contrast["episode_normal"]
    return [f"| {mode} | {np.mean(rates['ddpm']):.3f} ({', '.join(f'{r:.2f}' for r in rates['ddpm'])}) | "
            f"{np.mean(rates['ddim']):.3f} ({', '.join(f'{r:.2f}' for r in rates['ddim'])}) | "
            f"{contrast['estimate']:+.3f} | [{low:+.3f}, {high:+.3f}] | [{elow:+.3f}, {ehigh:+.3f}] |"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    modes = ["stochastic", *(["deterministic"] if args.deterministic else [])]
    started = time.time()
    results: dict[str, dict[str, dict[str, list[dict]]]] = {mode: {} for mode in modes}
    for mode in modes:
        for checkpoint in args.bc_checkpoints:
            results[mode][checkpoint] = {chain: episodes_of(checkpoint, chain, args, mode == "deterministic")
                                         for chain in CHAINS}
    lines = ["| rollouts | DDPM chain success (per seed) | DDIM chain success (per seed) | DDIM - DDPM | "
             "95% bootstrap (seeds x episodes) | 95% episode-normal |", "|---|---|---|---|---|---|"]
    for mode in modes:
        per_seed = [paired_arrays(results[mode][checkpoint]) for checkpoint in args.bc_checkpoints]
        lines += summary_lines(mode, per_seed, args.n_boot)
    print(f"- {len(args.bc_checkpoints)} BC checkpoints x {args.episodes} episodes per chain; DDIM {args.ddim_steps} "
          f"steps; {time.time() - started:.0f} s")
    print("\n".join(lines))
    if args.out is not None:
        atomic_write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "episodes": results,
                                     "table": lines})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
