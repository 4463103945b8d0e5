"""The DPPO robosuite bench pipeline shared by ``bench/bench_dppo_lift.py`` and ``bench/bench_dppo_vs_gaussian.py``.

Options (:func:`build_parser`, :func:`finish_args`), demo files, diffusion BC, Lightning fits of BC and RL
modules, the bench's DPPOModule and the paired deterministic evaluation (every policy of a seed meets the
same initial states, see :func:`evaluate`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

# Task-dependent defaults, filled in by finish_args for the options the user left unset (their parser default is
# None). lift: the values this bench always had. can: noise 0.3 is the largest level of bench/RESULTS.md's "Scripted-
# expert success rate vs action noise" (Can expert 22/30 successful, demos ~213 steps; our choice, the paper trains
# on robomimic's human demos); 300-step episodes are the DPPO paper's Can config (irom-lab/dppo
# cfg/robomimic/finetune/can/ft_ppo_diffusion_mlp.yaml, env.max_episode_steps), needed as Can demos run ~165-215
# steps. Everything else the bench fixes (horizon = act_steps = 4, K = 20, K' = 10, MLP [512]x3, clip 0.001 -> 0.01,
# 10 update epochs, 2 critic warm-up iterations) is the paper's for Can as for Lift.
# Any other task with a scripted expert in the registry (mmpo.robotics.envs.register_task) runs with noise 0.3 and
# its registry entry's max_episode_steps.
TASK_DEFAULTS = {"lift": {"noise": 0.5, "max_episode_steps": 150},
                 "can": {"noise": 0.3, "max_episode_steps": 300}}
OTHER_TASK_NOISE = 0.3


def task_defaults(task: str) -> dict[str, float | int]:
    """The bench's defaults of ``task``: its tuned ones, else noise 0.3 and the registry's episode length."""
    from mmpo.robotics.envs import TASKS

    return TASK_DEFAULTS.get(task, {"noise": OTHER_TASK_NOISE, "max_episode_steps": TASKS[task].max_episode_steps})


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The bench's options (bench/bench_dppo_vs_gaussian.py adds its own to the same parser)."""
    parser = argparse.ArgumentParser(description=description)
    from mmpo.robotics.envs import expert_tasks

    parser.add_argument("--task", default="lift", choices=expert_tasks(),
                        help="robosuite task: lift (default) or can (PickPlaceCan). Obs/action dims come from the task "
                             "registry; options left unset take the task's default (their help lists both). The DPPO "
                             "paper's Can config (irom-lab/dppo cfg/robomimic/finetune/can/ft_ppo_diffusion_mlp.yaml) "
                             "gives Can 300-step episodes; its horizon 4, act_steps 4, K 20, K' 10, MLP [512]x3, clip "
                             "0.001 -> 0.01, 10 update epochs and 2 critic warm-up iterations are this bench's for both "
                             "tasks; its actor lr 1e-5, 50 envs and batch 7500 are not (--actor-lr, --num-envs and "
                             "--batch-size keep this bench's defaults for both tasks)")
    parser.add_argument("--out-dir", default="runs/bench_dppo_lift")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--num-demos", type=int, default=100)
    parser.add_argument("--noise", type=float, default=None,
                        help="expert action noise std (default: lift 0.5, can 0.3). Lift 0.5: mediocre BC, ~50%% "
                             "deterministic success; 0.3: BC ~100%%. Can 0.3: the noisiest level measured for the Can "
                             "expert (73%% successful attempts; our choice, not the paper's)")
    parser.add_argument("--bc-epochs", type=int, default=100)
    parser.add_argument("--bc-lr", type=float, default=1e-3)
    parser.add_argument("--hidden", type=int, default=512, help="residual-MLP width (DPPO lift and can: 512)")
    parser.add_argument("--denoising-steps", type=int, default=20)
    parser.add_argument("--ft-steps", type=int, default=10)
    parser.add_argument("--dppo-env-steps", type=int, default=20_000, help="fine-tuning budget in env steps")
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--n-steps", type=int, default=None,
                        help="chunk steps per env per iteration (default: one full episode, "
                             "ceil(max-episode-steps / 4); envs reset every iteration as in DPPO's robomimic "
                             "setup, so a smaller value cuts every training episode short)")
    parser.add_argument("--max-episode-steps", type=int, default=None,
                        help="episode limit (default: lift 150, as noise-0.5 Lift demos are <= ~120 steps, the paper "
                             "has 300; can 300, the DPPO paper's Can config, as Can demos run ~165-215 steps)")
    parser.add_argument("--batch-size", type=int, default=1000, help="(env step, denoising step) pairs")
    parser.add_argument("--update-epochs", type=int, default=10)
    parser.add_argument("--actor-lr", type=float, default=1e-4)
    parser.add_argument("--clip-base", type=float, default=0.001)
    parser.add_argument("--clip-final", type=float, default=0.01)
    parser.add_argument("--critic-warmup", type=int, default=2)
    parser.add_argument("--eval-episodes", type=int, default=50)
    parser.add_argument("--stochastic-eval-episodes", type=int, default=0,
                        help="also evaluate with training-time (stochastic) sampling on this many episodes")
    # Default DDIM eta = 0: on our briefly trained Lift BC policies the DDPM step means (DPPO's own
    # evaluation) succeed almost never while DDIM eta = 0 gives ~50% (bench/RESULTS.md, robotics, run C).
    parser.add_argument("--eval-sampler", default="ddim", choices=["ddpm", "ddim"],
                        help="deterministic chain: DDIM eta = 0 (default) or DDPM step means (as DPPO)")
    parser.add_argument("--throughput-steps", type=int, default=400, help="sim steps per env for the probe")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sync-envs", action="store_true", help="in-process envs instead of subprocesses")
    parser.add_argument("--dppo-max-minutes", type=float, default=None,
                        help="wall-clock cap on each seed's fine-tuning (Lightning max_time); the env steps "
                             "actually used are reported")
    parser.add_argument("--demos", default=None,
                        help="demo file (default: <out-dir>/<task>_demos_n<N>_noise<X>.hdf5); its env must be the task's")
    parser.add_argument("--demos-only", action="store_true", help="only generate the demo file, then exit")
    return parser


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the task's defaults (TASK_DEFAULTS) into the options left unset; default ``--n-steps`` to one full
    episode; warn when rollouts cut every training episode."""
    for name, value in task_defaults(args.task).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.n_steps is None:
        args.n_steps = math.ceil(args.max_episode_steps / 4)
    elif args.n_steps * 4 < args.max_episode_steps:
        print(f"warning: --n-steps {args.n_steps} x 4 < --max-episode-steps {args.max_episode_steps}: envs reset "
              "every DPPO iteration, so no training episode reaches its time limit (training success is NaN)",
              file=sys.stderr)
    return args


def task_spec(args):
    """The task registry's entry (sim name, obs_dim, action_dim) of ``args.task``."""
    from mmpo.robotics.envs.tasks import get_task

    return get_task(args.task)


def task_of(args: dict) -> str:
    """The task of a run's options (``vars(args)`` or a record's ``args``): runs from before --task are lift."""
    return args.get("task") or "lift"


def default_demos(args, out_dir: Path) -> Path:
    """``--demos``, else ``<out-dir>/<task>_demos_n<N>_noise<X>.hdf5``."""
    return Path(args.demos) if args.demos else out_dir / f"{args.task}_demos_n{args.num_demos}_noise{args.noise}.hdf5"


def check_demos(demos: Path, args) -> None:
    """A demo file recorded on another task's simulator (robomimic ``env_args['env_name']``) is an error."""
    from mmpo.robotics.data import read_env_args

    env_name, expected = read_env_args(demos).get("env_name"), task_spec(args).sim_name
    if env_name != expected:
        raise ValueError(f"{demos} holds {env_name} demos, not {expected} ones (--task {args.task})")


def evaluate(policy, args, seed: int, normalizer_path: str, *, deterministic: bool = True,
             episodes: int | None = None, episode_records: list | None = None,
             sampler: str | None = "args", seed_base: int = 100_000) -> dict[str, float]:
    """Deterministic (or stochastic) evaluation on ``args.num_envs`` envs seeded ``seed_base + seed`` (env i:
    + i), so every policy of a seed meets the same initial states; the chains' initial noise is seeded
    alike. ``episode_records`` (a list) receives one dict per counted episode (see ``evaluate_policy``);
    ``sampler``: the deterministic chain, default ``args.eval_sampler`` (None: the policy's own); ``seed_base``:
    another base (a validation set of initial states disjoint from the test set's 100_000 + seed)."""
    from mmpo.robotics.envs import make_vector_env
    from mmpo.robotics.evaluate import evaluate_policy

    # Episodes end at the first success here: the success metric is unchanged (any-step success)
    # and evaluation gets cheaper; DPPO training episodes still run to the time limit.
    envs = make_vector_env(args.task, args.num_envs, seed=seed_base + seed, act_steps=4, normalizer_path=normalizer_path,
                           max_episode_steps=args.max_episode_steps, asynchronous=not args.sync_envs,
                           terminate_on_success=True)
    try:
        start = time.perf_counter()
        result = evaluate_policy(policy.to(args.device), envs, episodes or args.eval_episodes,
                                 deterministic=deterministic, seed=seed_base + seed, progress=True,
                                 deterministic_sampler=args.eval_sampler if sampler == "args" else sampler,
                                 generator=torch.Generator(device=args.device).manual_seed(seed_base + seed),
                                 episode_records=episode_records)
        result["seconds"] = time.perf_counter() - start
    finally:
        envs.close()
    return result


def train_diffusion_bc(seed: int, args, demos: Path, seed_dir: Path) -> tuple[Path, float]:
    """Diffusion BC (DDPM eps-MSE, EMA 0.995) on ``demos``: (checkpoint ``seed_dir/bc.ckpt``, seconds)."""
    from mmpo.robotics.bc import BCModule

    spec = task_spec(args)
    pl.seed_everything(seed, verbose=False)
    bc = BCModule(obs_dim=spec.obs_dim, action_dim=spec.action_dim, horizon=4, act_steps=4,
                  denoising_steps=args.denoising_steps, hidden_dims=[args.hidden] * 3, lr=args.bc_lr,
                  lr_min=args.bc_lr / 10, warmup_steps=50, task=args.task, max_episode_steps=args.max_episode_steps,
                  export_safetensors=False)
    return fit_bc(bc, args, demos, seed_dir)


def fit_bc(module: pl.LightningModule, args, demos: Path, seed_dir: Path) -> tuple[Path, float]:
    """``--bc-epochs`` epochs of a BC module on ``demos`` (batch 256): (checkpoint ``seed_dir/bc.ckpt``, seconds)."""
    from mmpo.training.checkpoint import VerifiedCheckpointIO
    from mmpo.robotics.bc import ChunkDataModule

    data = ChunkDataModule(str(demos), horizon=4, batch_size=256)
    start = time.perf_counter()
    trainer = pl.Trainer(max_epochs=args.bc_epochs, accelerator=args.device, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=seed_dir,
                         plugins=[VerifiedCheckpointIO()])
    trainer.fit(module, data)
    seconds = time.perf_counter() - start
    trainer.save_checkpoint(seed_dir / "bc.ckpt")
    return seed_dir / "bc.ckpt", seconds


def fit_rl(module: pl.LightningModule, args, seed_dir: Path, callback: pl.Callback, ckpt_name: str,
           ckpt_path: Path | None = None) -> tuple[Path, float]:
    """One Lightning fit of a DPPO-style module (one batch = one iteration), capped by ``--dppo-max-minutes``:
    (checkpoint ``seed_dir/ckpt_name``, seconds). ``ckpt_path``: resume from it (Lightning's ``fit(ckpt_path=)``)."""
    from mmpo.training.checkpoint import VerifiedCheckpointIO

    start = time.perf_counter()
    max_time = None if args.dppo_max_minutes is None else {"seconds": int(args.dppo_max_minutes * 60)}
    trainer = pl.Trainer(max_epochs=1, accelerator=args.device, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=seed_dir,
                         callbacks=[callback], max_time=max_time, plugins=[VerifiedCheckpointIO()])
    trainer.fit(module, ckpt_path=ckpt_path)
    seconds = time.perf_counter() - start
    trainer.save_checkpoint(seed_dir / ckpt_name)
    return seed_dir / ckpt_name, seconds


def rl_iterations(args) -> int:
    """Iterations that cover ``--dppo-env-steps`` (num_envs x n_steps chunk steps x 4 actions each)."""
    return max(1, math.ceil(args.dppo_env_steps / (args.num_envs * args.n_steps * 4)))


def rl_env(args) -> dict:
    """The bench's ``env`` group of an RL module (the task and its normaliser come with the BC checkpoint)."""
    return {"num_envs": args.num_envs, "n_steps": args.n_steps, "max_episode_steps": args.max_episode_steps,
            "asynchronous": not args.sync_envs}


def dppo_module(bc_ckpt: Path, args, seed: int, **settings):
    """The bench's DPPOModule (the paper's Lift and Can settings, the budget knobs from ``args``; the task comes
    with the BC checkpoint); ``settings`` override, a group field by field (``evaluation={"every": 5}``)."""
    from mmpo.robotics.config import merged_settings
    from mmpo.robotics.dppo import DPPOModule

    return DPPOModule(**merged_settings(dict(
        bc_checkpoint=str(bc_ckpt), num_iterations=rl_iterations(args), env=rl_env(args),
        chain={"ft_steps": args.ft_steps, "clip_base": args.clip_base, "clip_final": args.clip_final},
        optim={"lr": args.actor_lr, "mu": args.update_epochs, "minibatch_size": args.batch_size},
        critic={"warmup_iterations": args.critic_warmup}, evaluation={"every": 0}, seed=seed), settings))
