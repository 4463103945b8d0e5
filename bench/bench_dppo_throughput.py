"""Benchmark: DPPO collection env steps/s vs the raw single-environment simulator, side by side in one run.

The configurations of ``--configs`` (default: all), measured in ABBA order per round (raw, then each
configuration, then the same backwards: raw, DDPM, DDIM, ..., DDIM, DDPM, raw) so that drift in machine load
hits them alike, then each policy alone (batched ``act`` calls, no env) once per round:

- ``raw``: one robosuite env in this process, random actions (``mmpo.robotics.envs.make_env``), no policy;
- ``raw, all cores`` (always measured, not a configuration): one such env in each of ``os.cpu_count()``
  worker processes stepping at once, total env steps / wall time: what the machine's cores deliver together,
  the ceiling of any collection on them (the issue's goal assumes raw x cores);
- ``ddpm``: ``DPPOModule.collect_rollout`` on ``--num-envs`` subprocess envs, one batched policy call per
  chunk step over all envs, the policy's own K-step DDPM chain (K = ``--denoising-steps``);
- ``ddim``: the same with ``rollout_ddim_steps = --ddim-steps`` (DDIM eta = 1 over a strided subset of the
  K timesteps, same network: fewer network calls per chunk step);
- ``ddpm grouped`` / ``ddim grouped``: the same with ``env_groups = --env-groups`` (default 2; pipelined
  collection: the envs in groups, one group's actions computed while the other groups' workers step);
- ``ddim grouped, 2x envs``: ``ddim grouped`` on twice ``--num-envs`` envs (more workers than cores: a
  group's workers can run while this process computes);
- ``ddim grouped, reset prefetched``: ``ddim grouped`` with ``prefetch_reset``: the rollout's env reset is
  sent to the workers before the timer starts and ``--update-seconds`` (untimed, idle) stand for the PPO
  update it overlaps in training, so the timed rollout collects a finished reset (the other rows time the
  reset: one robosuite hard reset, ~0.1 s per env, per ``--n-steps`` x ``--act-steps`` env steps);
- ``ddim grouped, reset prefetched, final autoreset skipped`` and the same with ``ddpm``: with
  ``skip_final_autoreset`` (DPPOModule's default), an env whose episode ends on the rollout's last chunk step
  is not auto-reset (the next rollout resets it anyway). The other rows run with it off, as recorded before it
  existed. It only matters when episodes end on a rollout's last step: run with the training shape
  ``--n-steps 38 --max-episode-steps 150`` (Lift's 150-step episodes end inside the 38th 4-step chunk).

The first three are the rows recorded before pipelining (bench/RESULTS.md, issue 19); all configurations'
env workers exist at once (idle ones wait on their pipes).

The policy is a randomly initialised Lift-sized diffusion policy (MLP [512] x 3, Ta = 4): throughput does
not depend on what it learned. Env construction is excluded; each rollout's env reset is included (as in
training, reset_at_iteration). The issue's goal is ddpm/ddim >= 0.8 x raw x cores (1.6 x raw on 2 cores).

    OMP_NUM_THREADS=1 python bench/bench_dppo_throughput.py --rounds 3 --num-envs 2 --n-steps 25
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="lift")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-envs", type=int, default=2)
    parser.add_argument("--n-steps", type=int, default=25, help="chunk steps per env per measured rollout")
    parser.add_argument("--act-steps", type=int, default=4)
    parser.add_argument("--raw-steps", type=int, default=300, help="simulator steps per raw measurement")
    parser.add_argument("--denoising-steps", type=int, default=20)
    parser.add_argument("--ft-steps", type=int, default=10)
    parser.add_argument("--ddim-steps", type=int, default=5)
    parser.add_argument("--max-episode-steps", type=int, default=300)
    parser.add_argument("--env-groups", type=int, default=2, help="env_groups of the pipelined configurations")
    parser.add_argument("--update-seconds", type=float, default=0.5,
                        help="untimed pause standing for the PPO update in 'reset prefetched'")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        help="collection configurations to measure (raw is always measured)")
    return parser.parse_args(argv)


#: name -> (DDIM rollouts, pipelined (env_groups = --env-groups), envs as a multiple of --num-envs,
#: reset prefetched, final autoreset skipped)
CONFIGS: dict[str, tuple[bool, bool, int, bool, bool]] = {
    "ddpm": (False, False, 1, False, False),
    "ddim": (True, False, 1, False, False),
    "ddpm grouped": (False, True, 1, False, False),
    "ddim grouped": (True, True, 1, False, False),
    "ddim grouped, 2x envs": (True, True, 2, False, False),
    "ddim grouped, reset prefetched": (True, True, 1, True, False),
    "ddpm grouped, reset prefetched, final autoreset skipped": (False, True, 1, True, True),
    "ddim grouped, reset prefetched, final autoreset skipped": (True, True, 1, True, True),
}


def raw_steps_per_s(env, steps: int, rng: np.random.Generator) -> float:
    low, high = env.action_space.low, env.action_space.high
    start = time.perf_counter()
    for _ in range(steps):
        _, _, terminated, truncated, _ = env.step(rng.uniform(low, high))
        if terminated or truncated:
            env.reset()
    return steps / (time.perf_counter() - start)


def _raw_worker(pipe, task: str, seed: int, max_episode_steps: int) -> None:
    """One ``raw, all cores`` process: its own env; for each number of steps received, step and answer."""
    from mmpo.robotics.envs import make_env

    env = make_env(task, seed=seed, max_episode_steps=max_episode_steps)
    env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    pipe.send("ready")
    while (steps := pipe.recv()) is not None:
        pipe.send(raw_steps_per_s(env, steps, rng))
    env.close()


class RawOnAllCores:
    """``processes`` raw envs in their own processes, stepped at once: total env steps / wall seconds."""

    def __init__(self, processes: int, task: str, max_episode_steps: int) -> None:
        import multiprocessing

        context = multiprocessing.get_context("forkserver")
        self.pipes, self.processes = [], []
        for index in range(processes):
            parent, child = context.Pipe()
            process = context.Process(target=_raw_worker, args=(child, task, index, max_episode_steps), daemon=True)
            process.start()
            self.pipes.append(parent)
            self.processes.append(process)
        for pipe in self.pipes:
            if pipe.recv() != "ready":
                raise RuntimeError("a raw simulator process did not start")

    def steps_per_s(self, steps: int) -> float:
        start = time.perf_counter()
        for pipe in self.pipes:
            pipe.send(steps)
        for pipe in self.pipes:
            pipe.recv()
        return steps * len(self.pipes) / (time.perf_counter() - start)

    def close(self) -> None:
        for pipe, process in zip(self.pipes, self.processes):
            pipe.send(None)
            process.join(timeout=10)


def timed_collection(module, update_seconds: float = 0.0, cpu_s=time.process_time) -> dict[str, float]:
    """One ``module.collect_rollout()``: its env steps, wall seconds and ``cpu_s()`` seconds (this process by default;
    bench_finetuner_throughput.py passes the CPU of this process and its env workers)."""
    if module.env.prefetch_reset:  # as in training: the reset runs in the workers during the PPO update
        module.start_reset(module.iteration)
        time.sleep(update_seconds)
    before = module.train_tracker.env_steps
    start, cpu_start = time.perf_counter(), cpu_s()
    module.collect_rollout()
    wall, cpu = time.perf_counter() - start, cpu_s() - cpu_start
    return {"env_steps": float(module.train_tracker.env_steps - before), "wall_s": wall, "cpu_s": cpu}


def collection_steps_per_s(module, update_seconds: float = 0.0) -> float:
    timed = timed_collection(module, update_seconds)
    return timed["env_steps"] / timed["wall_s"]


def make_module(checkpoint: Path, name: str, args: argparse.Namespace):
    from mmpo.robotics.dppo import DPPOModule

    ddim, pipelined, env_factor, prefetch, skip = CONFIGS[name]
    env = dict(num_envs=args.num_envs * env_factor, n_steps=args.n_steps, asynchronous=True,
               env_groups=args.env_groups if pipelined else 1, prefetch_reset=prefetch, skip_final_autoreset=skip)
    if ddim:
        chain = dict(ft_steps=min(args.ft_steps, args.ddim_steps), rollout_ddim_steps=args.ddim_steps)
    else:
        chain = dict(ft_steps=args.ft_steps)
    return DPPOModule(str(checkpoint), env=env, chain=chain, evaluation={"every": 0}, seed=0)


def policy_only_steps_per_s(module, n_steps: int) -> float:
    """The policy's share alone: ``n_steps`` batched ``act`` calls on fixed obs, as env steps/s it could feed."""
    obs = torch.zeros(module.env.num_envs, module.policy.obs_dim)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(n_steps):
            module.act(obs)
    return n_steps * module.env.num_envs * module.act_steps / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from mmpo.robotics.bc import BCModule
    from mmpo.robotics.envs import make_env

    torch.manual_seed(0)
    bc = BCModule(obs_dim=19, action_dim=7, horizon=4, act_steps=args.act_steps, denoising_steps=args.denoising_steps,
                  hidden_dims=[512, 512, 512], export_safetensors=False, task=args.task,
                  max_episode_steps=args.max_episode_steps)
    checkpoint = Path(tempfile.mkdtemp()) / "bc.ckpt"
    torch.save({"state_dict": bc.state_dict(), "robotics": bc.robotics_metadata()}, checkpoint)
    names = [name for name in CONFIGS if name in args.configs]
    modules = {name: make_module(checkpoint, name, args) for name in names}
    raw_env = make_env(args.task, seed=0, max_episode_steps=args.max_episode_steps)
    raw_all_cores = RawOnAllCores(os.cpu_count() or 1, args.task, args.max_episode_steps)
    try:
        for module in modules.values():
            module.envs = module.make_envs()
        raw_env.reset(seed=0)
        rng = np.random.default_rng(0)
        results: dict[str, list[float]] = {name: [] for name in ["raw", "raw, all cores", *names]}
        order = ["raw", "raw, all cores", *names, *reversed(names), "raw, all cores", "raw"]
        for _ in range(args.rounds):
            for name in order:
                if name == "raw":
                    value = raw_steps_per_s(raw_env, args.raw_steps, rng)
                elif name == "raw, all cores":
                    value = raw_all_cores.steps_per_s(args.raw_steps)
                else:
                    value = collection_steps_per_s(modules[name], args.update_seconds)
                results[name].append(value)
            for name in ("ddpm", "ddim"):
                if name in modules:
                    results.setdefault(f"{name} policy only", []).append(
                        policy_only_steps_per_s(modules[name], args.n_steps))
    finally:
        raw_env.close()
        raw_all_cores.close()
        for module in modules.values():
            if module.envs is not None:
                module.envs.close()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    raw = statistics.mean(results["raw"])
    print(f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; commit {commit}; "
          f"load average at the end {os.getloadavg()}; {os.cpu_count()} CPUs; {platform.processor() or platform.machine()}")
    print(f"- settings: {vars(args)}")
    print("\n| configuration | env steps/s (mean) | min | max | x raw |")
    print("|---|---|---|---|---|")
    for name, values in results.items():
        print(f"| {name} | {statistics.mean(values):.1f} | {min(values):.1f} | {max(values):.1f} | "
              f"{statistics.mean(values) / raw:.2f} |")


if __name__ == "__main__":
    main()
