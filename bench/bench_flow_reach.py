"""Learning check of the flow-policy fine-tuners on the tiny 1-D reach task (issue 44): BC -> ReinFlow, BC -> FPO,
and BC -> DPPO for reference, over seeds, same env-step budget.

The reach task is the one the DPPO tests learn on (tests/robotics_reach.py: 12-step episodes, reward 1 inside the
goal band minus the distance, success = inside the band). Per seed s: 256 demos with *uniform random* actions
(a poor BC start) drawn with seed s; a flow BC (FlowBCModule, K = 4 Euler steps) and a diffusion BC (BCModule, K = 5
DDPM steps) on them, 10 epochs; each fine-tuner runs ``--iterations`` iterations of 16 envs x 6 chunk steps x
act_steps 2 from its BC (4,032 env steps at 21). Before and after, the deterministic policy plays ``--episodes``
episodes on envs seeded ``10_000 + s + i`` with the same initial noise stream, so episode (env, ordinal) starts
from the same state for BC and fine-tuned: the gain (fine-tuned - BC) is paired per episode and summarised over
seeds with the hierarchical paired bootstrap and the seed-t interval (mmpo.eval.stats.summarize_contrast).

Update settings (the same lr and clip for the three; chosen on seed 0 of this task, see bench/RESULTS.md): AdamW
lr 1e-3, 8 epochs, minibatches of 24 env steps, no target_kl, 1 critic warm-up iteration, gamma 0.99; ReinFlow clip
0.05 with its official std range [0.08, 0.14]; FPO clip 0.05 (official) with 8 MC samples; DPPO K' = 5, clip
0.1 -> 0.2 (the DPPO reach test's). DSRL steers the same frozen flow BC with its official SAC settings (lr 3e-4,
batch 256, utd 30 per vector step, tau 0.005, 2 critics, alpha from 1 to target entropy 0, m = 1.5) on 256 x 2 MLPs,
2 warm-up iterations of random noise and no reward offset.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/bench_flow_reach.py --seeds 0 1 2 --out runs/flow_reach.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the reach task is a test fixture

from mmpo.eval.stats import format_interval, summarize_contrast  # noqa: E402
from mmpo.files import atomic_write_json  # noqa: E402
from mmpo.robotics.bc import BCModule  # noqa: E402
from mmpo.robotics.dppo import DPPOModule  # noqa: E402
from mmpo.robotics.dsrl import DSRLModule  # noqa: E402
from mmpo.robotics.evaluate import evaluate_policy  # noqa: E402
from mmpo.robotics.flow_bc import FlowBCModule  # noqa: E402
from mmpo.robotics.fpo import FPOModule  # noqa: E402
from mmpo.robotics.reinflow import ReinFlowModule  # noqa: E402
from robotics_reach import reach_envs  # noqa: E402

METHODS = ("reinflow", "fpo", "dppo", "dsrl")
COMMON = dict(returns={"gamma": 0.99}, critic={"warmup_iterations": 1, "hidden_dims": [64, 64, 64]},
              evaluation={"every": 0, "episodes": 32}, loss={"target_kl": None}, env={"num_envs": 16, "n_steps": 6},
              optim={"lr": 1e-3, "minibatch_size": 24, "mu": 8}, env_factory=reach_envs)


# DSRL's official settings but smaller networks, no reward offset (reach is not robomimic), 2 warm-up iterations
DSRL_REACH = {"hidden_dims": [256, 256], "utd": 30, "warmup_chunk_steps": 12, "reward_offset": 0.0}


def _trainer(root: Path, epochs: int) -> pl.Trainer:
    return pl.Trainer(max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, default_root_dir=root)


def train_bc(cls: type, seed: int, root: Path, **policy: object) -> str:
    generator = torch.Generator().manual_seed(seed)
    obs = torch.cat([torch.rand(256, 1, generator=generator) * 0.6 - 0.3,
                     torch.randint(0, 2, (256, 1), generator=generator) * 1.2 - 0.6], dim=1)
    actions = torch.rand(256, 2, 1, generator=generator) * 2 - 1
    torch.manual_seed(seed)
    module = cls(obs_dim=2, action_dim=1, horizon=2, act_steps=2, hidden_dims=[64, 64, 64], lr=3e-3, lr_min=3e-3,
                 warmup_steps=1, export_safetensors=False, task="reach", seed=seed, **policy)
    trainer = _trainer(root, 10)
    trainer.fit(module, DataLoader(TensorDataset(obs, actions), batch_size=64, shuffle=True,
                                   generator=torch.Generator().manual_seed(seed)))
    path = root / f"{cls.__name__}_seed{seed}.ckpt"
    trainer.save_checkpoint(path)
    return str(path)


def build(method: str, checkpoint: str, seed: int, iterations: int) -> DPPOModule:
    torch.manual_seed(seed)
    if method == "reinflow":
        return ReinFlowModule(checkpoint, iterations, reinflow={"noise_hidden_dims": [32], "clip": 0.05}, seed=seed,
                              **COMMON)
    if method == "fpo":
        return FPOModule(checkpoint, iterations, fpo={"clip": 0.05}, seed=seed, **COMMON)
    if method == "dsrl":
        return DSRLModule(checkpoint, iterations, dsrl=DSRL_REACH, optim={"lr": 3e-4, "minibatch_size": 256}, seed=seed,
                          env=COMMON["env"], evaluation=COMMON["evaluation"], env_factory=reach_envs)
    return DPPOModule(checkpoint, iterations, chain={"ft_steps": 5, "clip_base": 0.1, "clip_final": 0.2}, seed=seed,
                      **{**COMMON, "optim": {**COMMON["optim"], "minibatch_size": 24 * 5}})


def episodes(policy: torch.nn.Module, seed: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(returns, successes) of ``count`` deterministic episodes, ordered by (env, ordinal)."""
    envs = reach_envs(16, 10_000 + seed, 2)
    records: list[dict] = []
    evaluate_policy(policy, envs, count, seed=10_000 + seed, generator=torch.Generator().manual_seed(seed),
                    episode_records=records)
    envs.close()
    records.sort(key=lambda r: (r["env"], r["ordinal"]))
    return (np.array([r["return"] for r in records], dtype=float),
            np.array([float(r["success"]) for r in records], dtype=float))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=21)
    parser.add_argument("--episodes", type=int, default=96)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--work", type=Path, default=Path("runs/flow_reach_work"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"error: {args.out} exists; choose another --out")
    torch.set_num_threads(1)
    args.work.mkdir(parents=True, exist_ok=True)
    per_seed: dict[str, list] = {method: [] for method in args.methods}
    seconds: dict[str, list[float]] = {method: [] for method in args.methods}
    for seed in args.seeds:
        bcs = {"flow": train_bc(FlowBCModule, seed, args.work, denoising_steps=4),
               "diffusion": train_bc(BCModule, seed, args.work, denoising_steps=5)}
        for method in args.methods:
            module = build(method, bcs["diffusion" if method == "dppo" else "flow"], seed, args.iterations)
            before = episodes(module.policy, seed, args.episodes)  # DSRL: the frozen flow BC, as for ReinFlow / FPO
            start = time.perf_counter()
            _trainer(args.work, 1).fit(module)
            seconds[method].append(time.perf_counter() - start)
            after = episodes(module.steered() if method == "dsrl" else module.policy, seed, args.episodes)
            per_seed[method].append({"bc_return": before[0], "ft_return": after[0], "bc_success": before[1],
                                     "ft_success": after[1], "env_steps": module.train_tracker.env_steps})
            print(f"seed {seed} {method}: return {before[0].mean():.2f} -> {after[0].mean():.2f}, success "
                  f"{before[1].mean():.3f} -> {after[1].mean():.3f} ({seconds[method][-1]:.1f} s)", flush=True)
    result: dict[str, object] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                 "methods": {}}
    lines = ["| method | BC return | fine-tuned return | gain (bootstrap) | gain (seed-t) | BC success | fine-tuned "
             "success | success gain (bootstrap) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for method, seeds in per_seed.items():
        returns = summarize_contrast([{"ft": s["ft_return"], "bc": s["bc_return"]} for s in seeds], {"ft": 1, "bc": -1})
        success = summarize_contrast([{"ft": s["ft_success"], "bc": s["bc_success"]} for s in seeds],
                                     {"ft": 1, "bc": -1})
        bc_return = float(np.mean([s["bc_return"].mean() for s in seeds]))
        ft_return = float(np.mean([s["ft_return"].mean() for s in seeds]))
        bc_success = float(np.mean([s["bc_success"].mean() for s in seeds]))
        ft_success = float(np.mean([s["ft_success"].mean() for s in seeds]))
        result["methods"][method] = {"return_gain": returns, "success_gain": success, "seconds": seconds[method],
                                     "bc_return": bc_return, "ft_return": ft_return, "bc_success": bc_success,
                                     "ft_success": ft_success, "env_steps": [s["env_steps"] for s in seeds]}
        lines.append(f"| {method} | {bc_return:.2f} | {ft_return:.2f} | {returns['estimate']:+.2f} "
                     f"{format_interval(returns['bootstrap'])} | {format_interval(returns['seed_t'])} | "
                     f"{bc_success:.3f} | {ft_success:.3f} | {success['estimate']:+.3f} "
                     f"{format_interval(success['bootstrap'])} |")
    result["table"] = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    print(result["table"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
