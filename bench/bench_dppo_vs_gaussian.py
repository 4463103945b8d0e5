"""Benchmark (issue 19): BC -> DPPO vs BC -> Gaussian-policy PPO on robosuite Lift or Can, paired, with intervals.

``--task lift`` (default) or ``--task can`` (PickPlaceCan): the task sets the demos (its scripted expert, default
file ``<out-dir>/<task>_demos_n<N>_noise<X>.hdf5``), the policies' obs/action dims (mmpo/robotics/envs/tasks.py), the
evaluation and RL envs, the plot title and the options left unset (mmpo.robotics.bench.TASK_DEFAULTS: Can takes noise
0.3 and the DPPO paper's 300-step Can episodes; lift keeps every default it had). Each record stores the task
(``task``; records from before the option are lift); --continue-from / --reuse-bc-from refuse a source of another
task, and an aggregate refuses records of more than one task (and of a task other than ``--task``).

Per seed and method (``--methods dppo gaussian``), on the same demo file:

- dppo: diffusion BC (bench_dppo_lift's recipe) -> deterministic eval -> DPPO for ``--dppo-env-steps``
  -> deterministic eval (DDIM eta = 0 by default, ``--eval-sampler``);
- gaussian: Gaussian-policy BC (MSE on the chunk mean, configs/robotics/gaussian_bc_lift.yaml's recipe)
  -> deterministic eval (the mean) -> Gaussian PPO (mmpo/robotics/gaussian_ppo.py) for the same env-step budget
  and rollout shape -> deterministic eval.

Every evaluation of a seed uses the same env seeds (100000 + seed + env index) and records each episode
under (env index, episode number), so before/after and DPPO/Gaussian are paired on initial states. The
curve is the training-rollout success of every iteration (stochastic sampling), plus, with
``--curve-eval-every``, a small deterministic eval inside the run. Each (seed, method) writes
``<out-dir>/seed<S>_<method>.json`` (atomically, after BC, after every RL iteration and at the end), so a
killed run leaves its finished parts. ``--aggregate`` reads those files (any number of ``--out-dir``s via
``--aggregate-dirs``), computes the gains with 95% intervals (bench/paired_intervals.py) and writes
``aggregate.{json,md}`` and the plot (``--plot``).

The Gaussian PPO update has its own ``--gaussian-actor-lr``, ``--gaussian-target-kl`` and
``--gaussian-update-epochs`` (default: the shared ``--actor-lr`` / ``--update-epochs`` and the module's
target_kl 1.0, the settings of every run before these options existed); each record stores the RL settings
that ran under ``rl_settings``. ``--reuse-bc-from DIR`` starts every (seed, method) from the BC checkpoint
an earlier run of this bench left in DIR (checked, copied and recorded) instead of training BC again, so a
rerun of one method starts from exactly the policy the other method's records were paired with.
``--aggregate-dirs`` entries may be ``METHOD=DIR`` (only that method's records from DIR), so a rerun of one
method pairs with the other method's records from an earlier run; a (seed, method) found twice is an error.
``--continue-from DIR`` runs a finished (seed, method) of DIR further, to this run's larger ``--dppo-env-steps``:
its last RL checkpoint (policy, critic, both optimizers, reward scaler, RNG and iteration; Lightning's loop state
rewritten from "epoch done" to "mid-epoch") resumes exactly as a killed run would, so the result is the longer
run (its only extra is the shorter run's final in-run eval, which has its own RNG). Every other option must be
the source run's; the record keeps the source's curve, evaluation and seconds under ``continued_from``.

    python bench/bench_dppo_vs_gaussian.py --seeds 0 --methods dppo gaussian --dppo-env-steps 60000 ...
    python bench/bench_dppo_vs_gaussian.py --aggregate --aggregate-dirs runs/a runs/b --plot bench/x.png
    python bench/bench_dppo_vs_gaussian.py --aggregate --aggregate-dirs dppo=runs/a gaussian=runs/b \
        --aggregate-seeds 0 1
    python bench/bench_dppo_vs_gaussian.py <the options of runs/a> --dppo-env-steps 300000 --continue-from runs/a \
        --out-dir runs/a300k --seeds 0 --methods dppo
    python bench/bench_dppo_vs_gaussian.py --task can --seeds 0 --out-dir runs/can ...
    python bench/bench_dppo_vs_gaussian.py --task can --aggregate --aggregate-dirs runs/can --plot bench/can.png
"""

from __future__ import annotations

import datetime
import inspect
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

from mmpo.robotics.bench import (  # noqa: E402
    build_parser,
    check_demos,
    default_demos,
    dppo_module,
    evaluate,
    finish_args,
    fit_bc,
    fit_rl,
    rl_iterations,
    task_of,
    task_spec,
    train_diffusion_bc,
)
from mmpo.eval.stats import format_interval, summarize_contrast  # noqa: E402
from mmpo.files import atomic_write_json  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

METHODS = ("dppo", "gaussian")
LABELS = {"dppo": "DPPO (diffusion)", "gaussian": "Gaussian PPO"}
# the options a reused BC checkpoint (--reuse-bc-from) must have been trained with (the demo file is checked
# through the checkpoint's normaliser; the task, lift when a record lacks it, too)
BC_KEYS = {"dppo": ("num_demos", "noise", "bc_epochs", "hidden", "max_episode_steps", "bc_lr", "denoising_steps"),
           "gaussian": ("num_demos", "noise", "bc_epochs", "hidden", "max_episode_steps", "gaussian_bc_lr")}


# the options --continue-from may change: the budget, where results go and what to run (any other must be the source's)
CONTINUE_FREE = {"out_dir", "seeds", "methods", "dppo_env_steps", "dppo_max_minutes", "continue_from", "reuse_bc_from",
                 "aggregate", "aggregate_dirs", "aggregate_seeds", "plot", "n_boot", "demos_only"}


def parse_args(argv: list[str] | None = None):
    parser = build_parser(__doc__.split("\n\n")[0])
    parser.set_defaults(out_dir="runs/bench_dppo_vs_gaussian", eval_episodes=100, num_envs=4, batch_size=600,
                        sync_envs=False)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--gaussian-clip", type=float, default=0.01, help="Gaussian PPO clip range (config: 0.01)")
    parser.add_argument("--gaussian-batch-size", type=int, default=None,
                        help="Gaussian PPO minibatch in env steps (default: --batch-size / --ft-steps, the same "
                             "number of minibatches per epoch as DPPO's (env step, denoising step) pairs)")
    parser.add_argument("--gaussian-bc-lr", type=float, default=1e-3)
    parser.add_argument("--gaussian-actor-lr", type=float, default=None,
                        help="Gaussian PPO actor lr (default: --actor-lr, DPPO's; the DPPO paper's Gaussian Lift "
                             "config: 1e-5)")
    parser.add_argument("--gaussian-target-kl", type=float, default=None,
                        help="Gaussian PPO: stop an iteration's update at the first minibatch whose approx_kl exceeds "
                             "this (default: the module's 1.0). With summed log-probs (4 x 7 chunk, the default), "
                             "its approx_kl is ~28^2 times that of a per-dimension mean (the DPPO paper's)")
    parser.add_argument("--gaussian-update-epochs", type=int, default=None,
                        help="Gaussian PPO epochs per iteration (default: --update-epochs)")
    parser.add_argument("--gaussian-log-prob-reduction", default="sum", choices=("sum", "mean"),
                        help="Gaussian PPO: sum (default) or average the log-probs (ratio, approx_kl) and entropy over "
                             "the executed 4 x 7 chunk; mean is the DPPO paper's Gaussian baseline "
                             "(model/rl/gaussian_vpg.py), on whose scale its clip 0.01 and target_kl 1 were set")
    parser.add_argument("--reuse-bc-from", default=None, metavar="DIR",
                        help="start from DIR/seed<S>/<method>/bc.ckpt (a previous run of this bench with the same "
                             "demos and BC settings, checked against its seed<S>_<method>.json) instead of training "
                             "BC; the checkpoint is sha256-verified, copied into this run's seed dir and its source "
                             "recorded (bc_seconds 0)")
    parser.add_argument("--continue-from", default=None, metavar="DIR",
                        help="run each (seed, method) that finished in DIR (an out-dir of this bench, same options) "
                             "further, from DIR/seed<S>/<method>/rl.ckpt to this run's larger --dppo-env-steps; BC is "
                             "reused from DIR (implies --reuse-bc-from DIR)")
    parser.add_argument("--curve-eval-every", type=int, default=0,
                        help="deterministic eval inside the RL run every this many iterations (0: none)")
    parser.add_argument("--curve-eval-episodes", type=int, default=12)
    parser.add_argument("--aggregate", action="store_true", help="only aggregate finished result files")
    parser.add_argument("--aggregate-dirs", nargs="+", default=None,
                        help="result dirs to aggregate (default --out-dir); METHOD=DIR takes only METHOD's records "
                             "from DIR (e.g. dppo=runs/i19/main gaussian=runs/i19/gauss_tuned)")
    parser.add_argument("--aggregate-seeds", type=int, nargs="+", default=None,
                        help="aggregate only these seeds (default: every seed found)")
    parser.add_argument("--plot", default=None, help="PNG path for the success-vs-env-steps plot (with --aggregate)")
    parser.add_argument("--n-boot", type=int, default=10_000)
    args = finish_args(parser.parse_args(argv))
    if args.gaussian_batch_size is None:
        args.gaussian_batch_size = max(1, args.batch_size // args.ft_steps)
    if args.continue_from:
        if args.reuse_bc_from not in (None, args.continue_from):
            parser.error("--continue-from DIR reuses DIR's BC: leave --reuse-bc-from out or give the same DIR")
        if Path(args.continue_from).resolve() == Path(args.out_dir).resolve():
            parser.error("--continue-from DIR must not be --out-dir: the continued run would overwrite the records and "
                         "checkpoints it continues")
        args.reuse_bc_from = args.continue_from
    return args


def module_default(name: str):
    """A DPPOModule (and so GaussianPPOModule) default the bench does not set, by its record name: ``target_kl``
    (``loss.target_kl``, 1.0)."""
    from mmpo.robotics.config import DPPO_FLAT_NAMES
    from mmpo.robotics.dppo import DPPOModule

    group, field = DPPO_FLAT_NAMES[name]
    return getattr(inspect.signature(DPPOModule.__init__).parameters[group].default, field)


def gaussian_ppo_settings(args: dict) -> dict:
    """The GaussianPPOModule update settings the options select. ``args``: ``vars(args)`` or a record's ``args``
    (records written before --gaussian-actor-lr / -target-kl / -update-epochs / -log-prob-reduction existed lack
    them: they ran the shared --actor-lr / --update-epochs, the module's target_kl and summed log-probs, as an unset
    option does now)."""
    def own(name: str, shared: str):
        return args[shared] if args.get(name) is None else args[name]

    target_kl = args.get("gaussian_target_kl")
    return {"actor_lr": own("gaussian_actor_lr", "actor_lr"),
            "update_epochs": own("gaussian_update_epochs", "update_epochs"),
            "target_kl": module_default("target_kl") if target_kl is None else target_kl,
            "clip_coef": args["gaussian_clip"], "batch_size": args["gaussian_batch_size"],
            "log_prob_reduction": args.get("gaussian_log_prob_reduction") or "sum"}


def rl_settings(method: str, args: dict) -> dict:
    """A method's PPO update settings as records and the aggregate report them (``batch_size``: env steps for
    gaussian, (env step, denoising step) pairs for dppo; gaussian has one clip range, clip_base = clip_final)."""
    if method == "gaussian":
        g = gaussian_ppo_settings(args)
        return {"actor_lr": g["actor_lr"], "target_kl": g["target_kl"], "update_epochs": g["update_epochs"],
                "batch_size": g["batch_size"], "clip_base": g["clip_coef"], "clip_final": g["clip_coef"],
                "log_prob_reduction": g["log_prob_reduction"]}
    return {"actor_lr": args["actor_lr"], "target_kl": module_default("target_kl"),
            "update_epochs": args["update_epochs"], "batch_size": args["batch_size"], "clip_base": args["clip_base"],
            "clip_final": args["clip_final"]}


def gaussian_module(bc_ckpt: Path, args, seed: int, **settings):
    """The bench's GaussianPPOModule (the budget knobs from ``args``, the update from the --gaussian-* options; the
    task comes with the BC checkpoint); ``settings`` override."""
    from mmpo.robotics.gaussian_ppo import GaussianPPOModule

    from mmpo.robotics.bench import rl_env
    from mmpo.robotics.config import merged_settings

    update = gaussian_ppo_settings(vars(args))
    return GaussianPPOModule(**merged_settings(dict(
        bc_checkpoint=str(bc_ckpt), num_iterations=rl_iterations(args), env=rl_env(args),
        critic={"warmup_iterations": args.critic_warmup}, seed=seed,
        optim={"lr": update["actor_lr"], "mu": update["update_epochs"], "minibatch_size": update["batch_size"]},
        loss={"target_kl": update["target_kl"]},
        gaussian={"clip_coef": update["clip_coef"], "log_prob_reduction": update["log_prob_reduction"]}), settings))


def code_commit() -> str | None:
    """The git commit the bench runs at (None outside a git checkout), recorded with every run."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class CurveRecorder(pl.Callback):
    """Appends each RL iteration's metrics to the task record and rewrites its JSON file."""

    def __init__(self, record: dict, path: Path) -> None:
        self.record, self.path = record, path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        m = {key: float(value) for key, value in module.last_metrics.items()}
        # wall seconds since the RL phase began (a --continue-from run counts the source's), for curves in wall time
        m["perf/rl_wall_s"] = time.perf_counter() - self.record["_rl_start"]
        self.record["curve"].append(m)
        self.record["rl_seconds_so_far"] = m["perf/rl_wall_s"]
        atomic_write_json(self.path, {k: v for k, v in self.record.items() if not k.startswith("_")})
        print(f"  {self.record['method']} s{self.record['seed']} itr {len(self.record['curve'])}: env steps "
              f"{m['perf/env_steps_total']:.0f} train success {m.get('charts/success_rate', float('nan')):.3f} "
              f"eval {m.get('eval/success_rate', float('nan')):.3f} clipfrac {m.get('policy/clipfrac', 0):.3f} "
              f"kl {m.get('policy/approx_kl', 0):.2e} (last {m.get('policy/approx_kl_last', 0):.2e}, "
              f"{m.get('policy/minibatches', 0):.0f} minibatches) env steps/s {m['perf/env_steps_per_s']:.0f}",
              flush=True)


def train_gaussian_bc(seed: int, args, demos: Path, seed_dir: Path) -> tuple[Path, float]:
    """Gaussian BC (MSE of the chunk mean; configs/robotics/gaussian_bc_lift.yaml's recipe, the task's dims) for
    ``--bc-epochs`` epochs."""
    from mmpo.robotics.gaussian_ppo import GaussianBCModule

    spec = task_spec(args)
    pl.seed_everything(seed, verbose=False)
    module = GaussianBCModule(obs_dim=spec.obs_dim, action_dim=spec.action_dim, horizon=4, act_steps=4,
                              hidden_dims=[args.hidden] * 3, init_std=0.1, min_std=0.01, lr=args.gaussian_bc_lr,
                              weight_decay=1e-6, task=args.task, max_episode_steps=args.max_episode_steps)
    return fit_bc(module, args, demos, seed_dir)


def reuse_bc(seed: int, method: str, args, demos: Path, seed_dir: Path) -> tuple[Path, dict]:
    """``--reuse-bc-from DIR``: DIR/seed<S>/<method>/bc.ckpt, checked (sha256 sidecar; DIR's record of that task
    ran the same BC options; its normaliser is this run's demos') and copied with its sidecar to
    ``seed_dir/bc.ckpt``. Returns (the copy, what the record stores about the source)."""
    from mmpo.training.checkpoint import checksum_status, file_sha256, sidecar_path
    from mmpo.robotics.gaussian_ppo import load_gaussian_policy
    from mmpo.robotics.policy.io import load_policy

    source_dir = Path(args.reuse_bc_from)
    source, source_record = source_dir / f"seed{seed}" / method / "bc.ckpt", source_dir / f"seed{seed}_{method}.json"
    if not (source.is_file() and source_record.is_file()):
        raise FileNotFoundError(f"--reuse-bc-from {source_dir}: needs {source} and {source_record} (an out-dir of "
                                "this bench that ran this seed and method)")
    status = checksum_status(source)
    if status != "ok":
        raise ValueError(f"--reuse-bc-from: {source} fails its sha256 check ({status})")
    previous = json.loads(source_record.read_text())
    differ = {key: (previous["args"].get(key), getattr(args, key)) for key in BC_KEYS[method]
              if previous["args"].get(key) != getattr(args, key)}
    if task_of(previous["args"]) != task_of(vars(args)):
        differ["task"] = (task_of(previous["args"]), task_of(vars(args)))
    if differ:
        raise ValueError(f"--reuse-bc-from: {source_record} trained BC with other settings (theirs, this run's): "
                         f"{differ}")
    metadata = (load_policy if method == "dppo" else load_gaussian_policy)(source)[1]
    normalizer, expected = Path(metadata["normalizer_path"]), Path(f"{demos}.stats.json")
    if not (normalizer.is_file() and expected.is_file() and os.path.samefile(normalizer, expected)):
        raise ValueError(f"--reuse-bc-from: {source} was trained on the demos of normaliser {normalizer} (resolved "
                         f"from {os.getcwd()}), not this run's {expected}: run where the source run ran, with its "
                         "--demos")
    target = seed_dir / "bc.ckpt"
    shutil.copyfile(source, target)
    shutil.copyfile(sidecar_path(source), sidecar_path(target))
    return target, {"from": str(source), "sha256": file_sha256(target), "source_bc_seconds": previous.get("bc_seconds")}


def continuation_checkpoint(source: Path, target: Path) -> int:
    """Write ``source`` (the checkpoint a finished one-epoch RL fit saved) to ``target`` as Lightning's mid-epoch
    state, so ``fit(ckpt_path=target)`` with more iterations continues at the next one instead of stopping at
    "max_epochs reached". Returns the iterations already run. The module's ``dppo_state`` (iteration, RNGs, env
    steps, reward scaler) is untouched: the DPPO loop resumes exactly as from a checkpoint taken mid-run."""
    from mmpo.training.checkpoint import VerifiedCheckpointIO, atomic_torch_save

    checkpoint = VerifiedCheckpointIO().load_checkpoint(source)
    loop = checkpoint["loops"]["fit_loop"]
    batches = loop["epoch_loop.batch_progress"]["current"]["completed"]
    if loop["epoch_progress"]["current"]["completed"] != 1 or batches != checkpoint["dppo_state"]["iteration"]:
        raise ValueError(f"{source} is not the end of a finished one-epoch RL fit (epochs "
                         f"{loop['epoch_progress']['current']}, batches {batches}, iteration "
                         f"{checkpoint['dppo_state']['iteration']})")
    for progress in (loop["epoch_progress"]["current"], loop["epoch_progress"]["total"]):
        progress.update(processed=0, completed=0)
    loop["epoch_loop.batch_progress"]["is_last_batch"] = False
    checkpoint["epoch"] = 0
    # Lightning's Timer (--dppo-max-minutes) restores its elapsed time from a checkpoint: a continued run would
    # count the source's minutes against its own cap (a run the cap stopped could never be continued)
    checkpoint.get("callbacks", {}).pop("Timer", None)
    atomic_torch_save(checkpoint, target, keep_previous=False)
    return int(batches)


def continuation_source(seed: int, method: str, args) -> tuple[Path, dict]:
    """``--continue-from DIR``: DIR's finished record of (seed, method) and its RL checkpoint (sha256-checked),
    after checking that every option but the budget and bookkeeping (CONTINUE_FREE) is the source run's."""
    from mmpo.training.checkpoint import checksum_status

    source_dir = Path(args.continue_from)
    ckpt, record_path = source_dir / f"seed{seed}" / method / "rl.ckpt", source_dir / f"seed{seed}_{method}.json"
    if not (ckpt.is_file() and record_path.is_file()):
        raise FileNotFoundError(f"--continue-from {source_dir}: needs {ckpt} and {record_path}")
    record = json.loads(record_path.read_text())
    if record.get("status") != "done":
        raise ValueError(f"--continue-from: {record_path} did not finish (status {record.get('status')!r})")
    status = checksum_status(ckpt)
    if status != "ok":
        raise ValueError(f"--continue-from: {ckpt} fails its sha256 check ({status})")
    mine = vars(args)
    differ = {key: (value, mine.get(key)) for key, value in record["args"].items()
              if key not in CONTINUE_FREE and value != mine.get(key)}
    # the demo file is compared as the file each run read, not as the option: a source that wrote its demos into
    # its own out-dir (no --demos) is continued by naming that file with --demos (the continuation's out-dir differs)
    if record.get("demos") is not None:  # records from before run_task wrote it compare the option
        differ.pop("demos", None)
        mine_demos = default_demos(args, Path(args.out_dir))
        if Path(record["demos"]).resolve() != mine_demos.resolve():
            differ["demos"] = (record["demos"], str(mine_demos))
    if task_of(record["args"]) != task_of(mine):  # a record from before --task ran lift
        differ["task"] = (task_of(record["args"]), task_of(mine))
    if record_settings(record) != rl_settings(method, mine):
        differ["rl_settings"] = (record_settings(record), rl_settings(method, mine))
    if differ:
        raise ValueError(f"--continue-from: {record_path} ran other options (theirs, this run's): {differ}")
    if rl_iterations(args) <= record["rl_iterations"]:
        raise ValueError(f"--continue-from: --dppo-env-steps {args.dppo_env_steps} is {rl_iterations(args)} "
                         f"iterations, not more than the {record['rl_iterations']} {record_path} ran")
    return ckpt, {**record, "source": str(record_path)}


def run_task(seed: int, method: str, args, demos: Path, out_dir: Path) -> dict:
    """BC -> eval -> RL -> eval for one (seed, method); the record is rewritten to disk at every stage."""
    from mmpo.robotics.gaussian_ppo import load_gaussian_policy
    from mmpo.robotics.policy.io import load_policy

    seed_dir = out_dir / f"seed{seed}" / method
    seed_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"seed{seed}_{method}.json"
    record = {"seed": seed, "method": method, "task": args.task, "status": "bc", "started": utc_now(),
              "commit": code_commit(), "demos": str(demos),
              "args": {k: v for k, v in vars(args).items()}, "rl_settings": rl_settings(method, vars(args)),
              "curve": []}
    atomic_write_json(path, record)
    if args.reuse_bc_from:
        bc_ckpt, record["bc_reused"] = reuse_bc(seed, method, args, demos, seed_dir)
        bc_seconds = 0.0
    elif method == "dppo":
        bc_ckpt, bc_seconds = train_diffusion_bc(seed, args, demos, seed_dir)
    else:
        bc_ckpt, bc_seconds = train_gaussian_bc(seed, args, demos, seed_dir)
    policy, metadata = (load_policy if method == "dppo" else load_gaussian_policy)(bc_ckpt)
    if metadata.get("task") != args.task:
        raise ValueError(f"{bc_ckpt} is a BC policy for task {metadata.get('task')!r}, not {args.task!r}")
    sampler = args.eval_sampler if method == "dppo" else None
    normalizer = metadata["normalizer_path"]
    print(f"[{method} s{seed}] BC " + (f"reused from {record['bc_reused']['from']}" if args.reuse_bc_from
                                       else f"done in {bc_seconds:.0f}s") + "; evaluating", flush=True)
    episodes: list[dict] = []
    record["before"] = evaluate(policy, args, seed, normalizer, episode_records=episodes, sampler=sampler)
    record.update(before_episodes=episodes, bc_seconds=bc_seconds, status="rl")
    atomic_write_json(path, record)
    print(f"[{method} s{seed}] BC eval: success {record['before']['success_rate']:.3f}", flush=True)

    curve_eval = {"every": args.curve_eval_every, "episodes": args.curve_eval_episodes}
    if method == "dppo":
        module = dppo_module(bc_ckpt, args, seed, evaluation={**curve_eval, "sampler": args.eval_sampler})
    else:
        module = gaussian_module(bc_ckpt, args, seed, evaluation=curve_eval)
    resume_from, seconds_before = None, 0.0
    if args.continue_from:
        source_ckpt, source = continuation_source(seed, method, args)
        resume_from = seed_dir / "continue_from.ckpt"
        iterations_before = continuation_checkpoint(source_ckpt, resume_from)
        seconds_before = source["rl_seconds"]
        record["curve"] = list(source["curve"])
        record["continued_from"] = {
            "record": source["source"], "rl_ckpt": str(source_ckpt), "rl_iterations": iterations_before,
            "env_steps": source["env_steps"], "rl_seconds": seconds_before, "after": source["after"],
            "after_episodes": source["after_episodes"], "before_matches": (
                episode_successes(source["before_episodes"]) == episode_successes(record["before_episodes"])),
            "commit": source.get("commit")}
        if not record["continued_from"]["before_matches"]:
            print(f"[{method} s{seed}] warning: the BC evaluation differs from {source['source']}'s", flush=True)
        print(f"[{method} s{seed}] continuing {source_ckpt} from iteration {iterations_before} to "
              f"{rl_iterations(args)}", flush=True)
    record["_rl_start"] = time.perf_counter() - seconds_before
    ckpt, rl_seconds = fit_rl(module, args, seed_dir, CurveRecorder(record, path), "rl.ckpt", ckpt_path=resume_from)
    rl_seconds += seconds_before
    del record["_rl_start"]
    if resume_from is not None:
        resume_from.unlink()  # a full copy of the source's checkpoint; the source keeps its own
    policy = (load_policy if method == "dppo" else load_gaussian_policy)(ckpt)[0]
    episodes = []
    record["after"] = evaluate(policy, args, seed, normalizer, episode_records=episodes, sampler=sampler)
    last = record["curve"][-1] if record["curve"] else {}
    record.update(after_episodes=episodes, rl_seconds=rl_seconds, rl_iterations=len(record["curve"]),
                  env_steps=last.get("perf/env_steps_total", 0.0), faults=last.get("perf/faults", 0.0),
                  rollout_env_steps_per_s=float(np.mean([m["perf/env_steps_per_s"] for m in record["curve"]])),
                  status="done", finished=utc_now())
    atomic_write_json(path, record)
    print(f"[{method} s{seed}] RL eval: success {record['after']['success_rate']:.3f} "
          f"(BC {record['before']['success_rate']:.3f}), {record['env_steps']:.0f} env steps in {rl_seconds:.0f}s",
          flush=True)
    return record


# ---------------------------------------------------------------------------------------------- aggregation
def parse_sources(entries: list[str], methods: tuple[str, ...] = METHODS) -> list[tuple[str | None, Path]]:
    """``--aggregate-dirs`` entries: ``DIR`` (every method) or ``METHOD=DIR`` (only METHOD's records; METHOD one of
    ``methods``, this bench's by default)."""
    sources = []
    for entry in entries:
        method, sep, directory = str(entry).partition("=")
        sources.append((method, Path(directory)) if sep and method in methods else (None, Path(entry)))
    return sources


def load_records(entries: list[str], methods: tuple[str, ...] = METHODS) -> list[dict]:
    """The records of ``entries`` (see :func:`parse_sources`), each with its file under ``source``. A (seed,
    method) found twice is an error (which one to pair would be a silent choice)."""
    records, seen = [], {}
    for method, directory in parse_sources(entries, methods):
        if not directory.is_dir():
            raise FileNotFoundError(f"--aggregate-dirs: {directory} is not a directory")
        for path in sorted(directory.glob("seed*_*.json")):
            record = json.loads(path.read_text())
            if method is not None and record["method"] != method:
                continue
            key = (record["seed"], record["method"])
            if key in seen:
                raise ValueError(f"seed {key[0]} {key[1]} is in {seen[key]} and in {path}: name the method to take "
                                 "from each directory (METHOD=DIR)")
            seen[key] = path
            records.append({**record, "source": str(path)})
    return records


def record_task(record: dict) -> str:
    """The task a record ran (stored since --task existed; before, every run was lift)."""
    return record.get("task") or task_of(record.get("args") or {})


def records_task(records: list[dict]) -> str:
    """The one task of ``records`` (lift when there are none); records of more than one task are an error, as
    an aggregate or plot pairing Lift with Can episodes would be meaningless."""
    tasks: dict[str, list[str]] = {}
    for record in records:
        tasks.setdefault(record_task(record), []).append(record.get("source") or f"seed {record['seed']} "
                                                                                  f"{record['method']}")
    if len(tasks) > 1:
        raise ValueError("records of more than one task: " + "; ".join(
            f"{task}: {', '.join(sources)}" for task, sources in sorted(tasks.items())))
    return next(iter(tasks), "lift")


def record_settings(record: dict) -> dict | None:
    """The RL settings a record ran: stored since --gaussian-actor-lr existed, else derived from its args."""
    if record.get("rl_settings"):
        return record["rl_settings"]
    return rl_settings(record["method"], record["args"]) if "args" in record else None


def episode_successes(episodes: list[dict]) -> dict[tuple[int, int], float]:
    return {(e["env"], e["ordinal"]): float(e["success"]) for e in episodes}


def evaluations(record: dict) -> dict[str, list[dict]]:
    """A finished record's 100-episode evaluations: ``before`` (BC), ``after`` and, for a ``--continue-from`` run,
    ``mid`` (the source run's final evaluation, at its budget)."""
    found = {"before": record["before_episodes"], "after": record["after_episodes"]}
    if "continued_from" in record:
        found["mid"] = record["continued_from"]["after_episodes"]
    return found


def paired_table(records: list[dict], methods: list[str],
                 whens: tuple[str, ...] = ("before", "after")) -> tuple[list[int], list[dict[str, np.ndarray]]]:
    """Seeds where every method finished (with every evaluation of ``whens``), and per seed the aligned 0/1 arrays
    ``<method>/<when>`` over the episode keys all those evaluations share."""
    done = {(r["seed"], r["method"]): r for r in records
            if r.get("status") == "done" and set(whens) <= set(evaluations(r))}
    seeds = sorted({s for s, _ in done if all((s, m) in done for m in methods)})
    table = []
    for seed in seeds:
        maps = {f"{m}/{when}": episode_successes(evaluations(done[(seed, m)])[when])
                for m in methods for when in whens}
        keys = sorted(set.intersection(*(set(v) for v in maps.values())))
        table.append({name: np.array([values[k] for k in keys]) for name, values in maps.items()})
    return seeds, table


def aggregate(records: list[dict], n_boot: int = 10_000, methods: tuple[str, ...] = METHODS) -> dict:
    """Per method of ``methods`` (default this bench's; bench/bench_flow_robomimic.py passes its own) the paired
    BC -> fine-tuned gain; the DPPO - Gaussian contrasts when both ran."""
    task = records_task(records)
    methods = [m for m in methods if any(r["method"] == m and r.get("status") == "done" for r in records)]
    result: dict = {"task": task, "methods": {}, "contrasts": {}}
    for method in methods:
        seeds, table = paired_table(records, [method])
        done = sorted((r for r in records if r["method"] == method and r.get("status") == "done"), key=lambda r: r["seed"])
        gain = {f"{method}/after": 1.0, f"{method}/before": -1.0}
        result["methods"][method] = {
            "seeds": seeds,
            "before": [float(t[f"{method}/before"].mean()) for t in table],
            "after": [float(t[f"{method}/after"].mean()) for t in table],
            "episodes": [int(t[f"{method}/before"].size) for t in table],
            "gain": summarize_contrast(table, gain, n_boot=n_boot) if table else None,
            "env_steps": [r["env_steps"] for r in done],
            "rl_iterations": [r["rl_iterations"] for r in done],
            "rl_seconds": [r["rl_seconds"] for r in done],
            "bc_seconds": [r["bc_seconds"] for r in done],
            "rollout_env_steps_per_s": [r["rollout_env_steps_per_s"] for r in done],
            "env_steps_per_s_overall": [r["env_steps"] / r["rl_seconds"] for r in done],
            "faults": [r["faults"] for r in done],
            "rl_settings": [record_settings(r) for r in done],
            "sources": [r.get("source") for r in done],
            "bc_reused_from": [r.get("bc_reused", {}).get("from") for r in done],
        }
        # --continue-from runs: the source's final evaluation (same episodes) and what the extra budget added
        mid_seeds, mid_table = paired_table(records, [method], ("before", "mid", "after"))
        if mid_table:
            sources = {r["seed"]: r["continued_from"] for r in done if "continued_from" in r}
            result["methods"][method]["continued"] = {
                "seeds": mid_seeds, "mid_env_steps": [sources[s]["env_steps"] for s in mid_seeds],
                "mid": [float(t[f"{method}/mid"].mean()) for t in mid_table],
                "gain_to_mid": summarize_contrast(mid_table, {f"{method}/mid": 1.0, f"{method}/before": -1.0},
                                                  n_boot=n_boot),
                "after_minus_mid": summarize_contrast(mid_table, {f"{method}/after": 1.0, f"{method}/mid": -1.0},
                                                      n_boot=n_boot)}
    if set(METHODS) <= set(methods):  # dppo and gaussian
        seeds, table = paired_table(records, list(METHODS))
        if table:
            result["contrasts"]["dppo_gain_minus_gaussian_gain"] = {"seeds": seeds, **summarize_contrast(
                table, {"dppo/after": 1.0, "dppo/before": -1.0, "gaussian/after": -1.0, "gaussian/before": 1.0},
                n_boot=n_boot)}
            result["contrasts"]["dppo_after_minus_gaussian_after"] = {"seeds": seeds, **summarize_contrast(
                table, {"dppo/after": 1.0, "gaussian/after": -1.0}, n_boot=n_boot)}
    result["unfinished"] = [{"seed": r["seed"], "method": r["method"], "status": r.get("status"),
                             "iterations": len(r.get("curve", [])),
                             "env_steps": (r["curve"][-1]["perf/env_steps_total"] if r.get("curve") else 0.0)}
                            for r in records if r.get("status") != "done"]
    return result


def interval(pair) -> str:
    """``[lo, hi]``; a seed-level t interval of one seed is undefined (NaN), shown as such."""
    return format_interval(pair, undefined="n/a (1 seed)")


def method_cells(label: str, m: dict) -> str:
    """A method row's cells up to its RL seconds (shared with bench_flow_robomimic's table): seeds, episodes,
    before / after per seed, means, gain and its three intervals, env steps and RL seconds per seed."""
    g = m["gain"]
    return (f"| {label} | {', '.join(map(str, m['seeds']))} | {', '.join(map(str, m['episodes']))} | "
            f"{' / '.join(f'{v:.2f}' for v in m['before'])} | {' / '.join(f'{v:.2f}' for v in m['after'])} | "
            f"{np.mean(m['before']):.3f} -> {np.mean(m['after']):.3f} | **{g['estimate']:+.3f}** | "
            f"**{interval(g['bootstrap'])}** | {interval(g['episode_normal'])} | {interval(g['seed_t'])} | "
            f"{' / '.join(f'{v:,.0f}' for v in m['env_steps'])} | {' / '.join(f'{v:.0f}' for v in m['rl_seconds'])} | ")


def markdown(result: dict) -> str:
    lines = ["| method | seeds | episodes/seed | before (det.) per seed | after (det.) per seed | mean before -> after "
             "| gain | 95% bootstrap (seeds x episodes) | 95% normal (episodes, seeds fixed) | 95% t (seeds) "
             "| env steps/seed | RL s/seed | env steps/s (RL overall) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, m in result["methods"].items():
        if m["gain"] is None:
            continue
        lines.append(method_cells(LABELS[method], m) +
                     f"{' / '.join(f'{v:.0f}' for v in m['env_steps_per_s_overall'])} |")
    for method, m in result["methods"].items():
        c = m.get("continued")
        if c is None:
            continue
        for name, contrast in (("gain at the source's budget (BC -> mid)", c["gain_to_mid"]),
                               ("added by the extra budget (mid -> after)", c["after_minus_mid"])):
            lines.append(
                f"| {LABELS[method]}: {name} | {', '.join(map(str, c['seeds']))} | | mid per seed "
                f"{' / '.join(f'{v:.2f}' for v in c['mid'])} at {' / '.join(f'{v:,.0f}' for v in c['mid_env_steps'])} "
                f"env steps | | | **{contrast['estimate']:+.3f}** | **{interval(contrast['bootstrap'])}** | "
                f"{interval(contrast['episode_normal'])} | {interval(contrast['seed_t'])} | | | |")
    for name, c in result["contrasts"].items():
        lines.append(f"| {name} | {', '.join(map(str, c['seeds']))} | | per seed "
                     f"{' / '.join(f'{v:+.2f}' for v in c['per_seed'])} | | | **{c['estimate']:+.3f}** | "
                     f"**{interval(c['bootstrap'])}** | {interval(c['episode_normal'])} | {interval(c['seed_t'])} | | | |")
    for u in result["unfinished"]:
        lines.append(f"\n- unfinished: {u['method']} seed {u['seed']} (status {u['status']}, "
                     f"{u['iterations']} RL iterations, {u['env_steps']:,.0f} env steps recorded)")
    lines.extend(settings_lines(result))
    if "task" in result:
        lines.append(f"\n- task: {result['task']}")
    return "\n".join(lines)


def settings_lines(result: dict) -> list[str]:
    """One line per method and distinct RL settings: which seeds ran them, from which records."""
    lines = []
    for method, m in result["methods"].items():
        groups: dict[str, list[int]] = {}
        for seed, settings in zip(m["seeds"], m["rl_settings"]):
            text = ("not recorded" if settings is None else
                    f"actor lr {settings['actor_lr']:g}, target_kl {settings['target_kl']}, update epochs "
                    f"{settings['update_epochs']}, clip {settings['clip_base']:g}"
                    + ("" if settings["clip_base"] == settings["clip_final"] else f" -> {settings['clip_final']:g}")
                    + f", minibatch {settings['batch_size']} " + ("env steps" if method == "gaussian" else "pairs")
                    # shown when not the default sum (records written before the option existed summed)
                    + ("" if settings.get("log_prob_reduction", "sum") == "sum"
                       else f", log-probs {settings['log_prob_reduction']} over the chunk"))
            groups.setdefault(text, []).append(seed)
        dirs = sorted({str(Path(s).parent) for s in m["sources"] if s})
        reused = sorted({str(Path(s).parents[2]) for s in m["bc_reused_from"] if s})
        for text, seeds in groups.items():
            lines.append(f"\n- {LABELS[method]} settings (seeds {', '.join(map(str, seeds))}): {text}"
                         + (f"; records {', '.join(dirs)}" if dirs else "")
                         + (f"; BC reused from {', '.join(reused)}" if reused else ""))
    return lines


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` finite values (NaN iterations, without finished episodes, skipped)."""
    out = np.full(values.shape, np.nan)
    for index in range(values.size):
        chunk = values[max(0, index - window + 1): index + 1]
        chunk = chunk[np.isfinite(chunk)]
        if chunk.size:
            out[index] = chunk.mean()
    return out


def plot(records: list[dict], path: Path, window: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mmpo.robotics.envs.tasks import get_task

    sim_name = get_task(records_task(records)).sim_name
    colors = {"dppo": "tab:blue", "gaussian": "tab:orange"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for method in METHODS:
        runs = sorted((r for r in records if r["method"] == method and r.get("curve")), key=lambda r: r["seed"])
        if not runs:
            continue
        curves = []
        for r in runs:
            steps = np.array([m["perf/env_steps_total"] for m in r["curve"]])
            train = smooth(np.array([m.get("charts/success_rate", np.nan) for m in r["curve"]]), window)
            axes[0].plot(steps, train, color=colors[method], alpha=0.35, lw=1)
            curves.append((steps, train))
            evals = [(m["perf/env_steps_total"], m["eval/success_rate"]) for m in r["curve"] if "eval/success_rate" in m]
            if evals:
                axes[1].plot(*zip(*evals), color=colors[method], alpha=0.5, lw=0, marker=".", ms=6)
            if r.get("status") == "done":
                points = [(0.0, r["before"]["success_rate"]), (r["env_steps"], r["after"]["success_rate"])]
                if "continued_from" in r:  # the source run's final evaluation, on the same episodes
                    points.insert(1, (r["continued_from"]["env_steps"], r["continued_from"]["after"]["success_rate"]))
                axes[1].plot(*zip(*points), color=colors[method], alpha=0.35, lw=1, marker="o", ms=4)
        # mean over the seeds that reached each iteration (a run still going or cut short ends early)
        length = max(c[0].size for c in curves)
        padded = np.full((2, len(curves), length), np.nan)
        for index, (steps, train) in enumerate(curves):
            padded[0, index, :steps.size], padded[1, index, :train.size] = steps, train
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean_steps, mean_train = np.nanmean(padded[0], axis=0), np.nanmean(padded[1], axis=0)
        axes[0].plot(mean_steps, mean_train, color=colors[method], lw=2.5, label=f"{LABELS[method]} (mean of {len(runs)})")
        finished = [r for r in runs if r.get("status") == "done"]
        if finished:
            before = np.mean([r["before"]["success_rate"] for r in finished])
            after = np.mean([r["after"]["success_rate"] for r in finished])
            points = [(0.0, before), (np.mean([r["env_steps"] for r in finished]), after)]
            if all("continued_from" in r for r in finished):
                points.insert(1, (np.mean([r["continued_from"]["env_steps"] for r in finished]),
                                  np.mean([r["continued_from"]["after"]["success_rate"] for r in finished])))
            axes[1].plot(*zip(*points), color=colors[method], lw=2.5, marker="s", label=f"{LABELS[method]}: BC -> final, {finished[0]['before']['episodes']:.0f} "
                                                   f"episodes (mean of {len(finished)} seeds)")
    axes[0].set(title=f"training-rollout success (stochastic), trailing mean of {window} iterations",
                xlabel="env steps", ylabel="success rate", ylim=(0, 1))
    axes[1].set(title="deterministic eval: BC -> (source run's end ->) final\nper seed (thin), mean (thick); "
                      "dots: in-run evals",
                xlabel="env steps")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"robosuite {sim_name}: BC -> DPPO vs BC -> Gaussian PPO (same demos, same env-step budget)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    if args.aggregate:
        records = load_records(args.aggregate_dirs or [args.out_dir])
        if args.aggregate_seeds is not None:
            records = [r for r in records if r["seed"] in args.aggregate_seeds]
        task = records_task(records)
        if records and task != args.task:
            raise ValueError(f"--aggregate: the records are {task} runs; aggregate them with --task {task} "
                             f"(this run's --task is {args.task})")
        result = aggregate(records, n_boot=args.n_boot)
        block = markdown(result)
        print(block)
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out_dir / "aggregate.json", result)
        (out_dir / "aggregate.md").write_text(block + "\n")
        if args.plot:
            plot(records, Path(args.plot))
            print(f"plot: {args.plot}")
        return 0
    torch.set_num_threads(1)
    from mmpo.robotics.demos import generate_demos

    out_dir.mkdir(parents=True, exist_ok=True)
    demos = default_demos(args, out_dir)
    if not demos.exists():
        stats = generate_demos(args.task, args.num_demos, demos, noise=args.noise, seed=1234, keep_failures=False)
        print(f"demos: {demos} expert success {stats['success_rate']}", flush=True)
    check_demos(demos, args)
    if args.demos_only:
        return 0
    for seed in args.seeds:
        for method in args.methods:
            run_task(seed, method, args, demos, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
