"""Benchmark (issue 44): BC -> DPPO, BC -> ReinFlow, BC -> FPO and BC -> DSRL on robosuite Lift (or Can, ``--task
can``), same demos, same env-step budget, paired deterministic evaluations over seeds.

Per seed S, on one demo file:

- two BC policies, trained once (``--bc-epochs``, MLP [hidden] x 3, lr ``--bc-lr`` -> /10, batch 256): the K = 20
  DDPM diffusion policy (bench/bench_dppo_vs_gaussian.py's recipe, ``train_diffusion_bc``) and the K =
  ``--flow-steps`` flow-matching policy (``FlowBCModule``, the same recipe); each is evaluated once, deterministically
  (``--eval-episodes`` episodes; DDIM eta = 0 for the diffusion policy, the noise-free Euler flow for the flow one),
  on the envs and initial states every policy of seed S meets (``mmpo.robotics.bench.evaluate``), and recorded in
  ``<out-dir>/bc_<family>_seed<S>.json``;
- four fine-tunings, each of ``--env-steps`` env steps (``iterations`` = ceil(env steps / (num_envs x n_steps x 4)),
  :func:`plan`) capped at ``--max-minutes`` of wall time: DPPO from the diffusion BC; ReinFlow, FPO and DSRL from the
  one flow BC. Settings: ``configs/robotics/<method>_<task>.yaml``'s ``init_args`` (``<method>_lift.yaml`` where a
  task has none, :func:`method_config`) with the bench's env, budget, seed and no in-run evaluation; DSRL's networks, update-to-data ratio and warm-up from ``--dsrl-hidden`` /
  ``--dsrl-utd`` / ``--dsrl-warmup-iterations`` (the config's 2048 x 3 at utd 30 is ~2 s per SAC step on one CPU
  thread) and its replay buffer sized to the run (it never overwrites). Each writes ``<out-dir>/seed<S>_<method>.json``
  (atomically, after every iteration and at the end) with the BC evaluation as ``before`` and the fine-tuned
  policy's, on the same episodes, as ``after``. DSRL's record also holds a stochastic evaluation (``after_stochastic``:
  the noise sampled from the SAC policy, ajwagen/dsrl's default ``deterministic_eval: False``) paired with the flow
  BC's (``before_stochastic``: for a flow BC the same seeded x_0 ~ N(0, I) chain as ``before``); ``--stochastic-only``
  adds both to finished records; every record's ``evaluation_modes`` says what each evaluation samples.

``--eval-seed-base`` moves the evaluation to other initial states (validation episodes for choosing a setting, e.g.
``--fpo-lr``); ``--bc-from DIR`` starts from DIR's BCs instead of training them.

Resumable and parallel: a finished record is skipped on a re-run; a task is claimed with an exclusive file under
``<out-dir>/claims/`` (a claim of a dead process is taken over), so two processes started on the same ``--out-dir``
share the work (seed-major: a seed's BCs, then its fine-tunings; a fine-tuning waits for its BC).
``--aggregate`` pools the records (bench_dppo_vs_gaussian's pairing and intervals: hierarchical paired bootstrap
over seeds x episodes, episode-normal, seed-t), adds every pairwise contrast of the methods' gains, and writes
``aggregate.{json,md}`` and, with ``--plot``, training success vs env steps and vs wall time plus BC -> final.

    python bench/bench_flow_robomimic.py --demos-only --out-dir runs/flow_lift --demos runs/flow_lift/demos.hdf5
    python bench/bench_flow_robomimic.py --out-dir runs/flow_lift --demos runs/flow_lift/demos.hdf5 \\
        --env-steps 12160 --max-minutes 20 &   # twice, for two workers
    python bench/bench_flow_robomimic.py --aggregate --out-dir runs/flow_lift --plot bench/flow_lift.png
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
import warnings
from itertools import combinations
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench scripts this one reuses

import bench_dppo_vs_gaussian as vs  # noqa: E402  (sets OMP/MKL to 1 thread)
from bench_finetuner_throughput import _class, model_init_args  # noqa: E402

import numpy as np  # noqa: E402

from mmpo.eval.stats import summarize_contrast  # noqa: E402
from mmpo.files import atomic_write_json  # noqa: E402
from mmpo.robotics.bench import (  # noqa: E402
    build_parser,
    check_demos,
    default_demos,
    evaluate,
    finish_args,
    fit_bc,
    fit_rl,
    rl_env,
    task_spec,
    train_diffusion_bc,
)

METHODS = ("dppo", "reinflow", "fpo", "dsrl")
LABELS = {"dppo": "DPPO (diffusion)", "reinflow": "ReinFlow (flow)", "fpo": "FPO (flow)", "dsrl": "DSRL (flow, SAC)"}
COLORS = {"dppo": "tab:blue", "reinflow": "tab:green", "fpo": "tab:red", "dsrl": "tab:purple"}
#: the BC policy each method starts from
FAMILY = {"dppo": "diffusion", "reinflow": "flow", "fpo": "flow", "dsrl": "flow"}
#: methods whose records also hold a stochastic evaluation (``after_stochastic``), paired with the flow BC's
#: (``before_stochastic``); the aggregate reports them as the row ``<method>_stochastic``
STOCHASTIC = ("dsrl",)
LABELS["dsrl_stochastic"] = "DSRL (flow, SAC), stochastic eval"
COLORS["dsrl_stochastic"] = "tab:pink"
#: what each evaluation a record holds means (stored in every record under ``evaluation_modes``); every one plays
#: the envs seeded ``--eval-seed-base`` + seed + i, and the chains' noise comes from a generator seeded alike
EVALUATION_MODES = {
    "diffusion": {"before": "diffusion BC, deterministic: DDIM eta = 0 from a seeded x_K ~ N(0, I)"},
    "flow": {"before": "flow BC: noise-free Euler flow from a seeded x_0 ~ N(0, I)",
             "before_stochastic": "flow BC, evaluate_policy(deterministic=False): a flow BC has no noise network, so "
                                  "this is the same chain as 'before' (seeded x_0 ~ N(0, I), noise-free Euler), run "
                                  "again as the like-for-like start of DSRL's stochastic evaluation"},
    "dppo": {"after": "DPPO, deterministic: DDIM eta = 0 from a seeded x_K ~ N(0, I)"},
    "reinflow": {"after": "ReinFlow, deterministic: the Euler flow's means (no injected noise) from a seeded x_0"},
    "fpo": {"after": "FPO, deterministic: noise-free Euler flow from a seeded x_0 ~ N(0, I)"},
    "dsrl": {"after": "DSRL, deterministic: x_0 = m tanh(mean(s)), the SAC actor's mean noise, through the frozen "
                      "flow (m = action_magnitude)",
             "after_stochastic": "DSRL, stochastic (ajwagen/dsrl deterministic_eval: False): x_0 = m tanh(u), u ~ "
                                 "N(mean(s), std(s)^2) drawn from the seeded generator, through the frozen flow"},
}


def evaluation_modes(name: str) -> dict[str, str]:
    """What each evaluation in the record of ``name`` (a BC family or a method) samples: its BC family's entries, then
    its own."""
    return {**EVALUATION_MODES[FAMILY.get(name, name)], **EVALUATION_MODES.get(name, {})}


def parse_args(argv: list[str] | None = None):
    parser = build_parser(__doc__.split("\n\n")[0])
    parser.set_defaults(out_dir="runs/bench_flow_lift", eval_episodes=100, num_envs=4, sync_envs=False)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--env-steps", type=int, default=None,
                        help="fine-tuning budget of every method in env steps (sets --dppo-env-steps)")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="wall-clock cap on each fine-tuning (sets --dppo-max-minutes); the record says if it bound")
    parser.add_argument("--flow-steps", type=int, default=4, help="Euler steps K of the flow policy (flow_bc_lift.yaml)")
    parser.add_argument("--dsrl-hidden", type=int, nargs="+", default=[256, 256, 256],
                        help="DSRL actor and critic widths (config: 2048 2048 2048)")
    parser.add_argument("--dsrl-utd", type=int, default=30, help="DSRL SAC steps per vector-env chunk step (config: 30)")
    parser.add_argument("--dsrl-warmup-iterations", type=int, default=1,
                        help="DSRL iterations of random noise before SAC acts (config: 375 chunk steps = 5 iterations)")
    parser.add_argument("--eval-seed-base", type=int, default=100_000,
                        help="evaluation envs seeded BASE + seed + i (100000: the test episodes; another base, e.g. "
                             "200000, a validation set of other initial states, for choosing settings)")
    parser.add_argument("--fpo-lr", type=float, default=None, help="FPO's actor lr (default: its config's optim.lr)")
    parser.add_argument("--bc-from", default=None, metavar="DIR",
                        help="take each seed's BCs from DIR's records (bc_<family>_seed<S>.json and their "
                             "checkpoints) instead of training them; their evaluations are copied where DIR evaluated "
                             "the same initial states (seed base, episodes, envs), else run here")
    parser.add_argument("--stochastic-only", action="store_true",
                        help="only add the stochastic evaluations (flow BC, DSRL) missing from --out-dir's finished "
                             "records (two processes share the work, as the main run)")
    parser.add_argument("--poll-seconds", type=float, default=10.0,
                        help="how often a worker waiting on another's BC looks again")
    parser.add_argument("--aggregate", action="store_true", help="only aggregate finished records")
    parser.add_argument("--aggregate-dirs", nargs="+", default=None,
                        help="record dirs (default --out-dir): DIR (every method's records) or METHOD=DIR (METHOD's)")
    parser.add_argument("--plot", default=None, help="PNG path of the curves (with --aggregate)")
    parser.add_argument("--n-boot", type=int, default=10_000)
    args = parser.parse_args(argv)
    if args.env_steps is not None:
        args.dppo_env_steps = args.env_steps
    if args.max_minutes is not None:
        args.dppo_max_minutes = args.max_minutes
    args.env_steps, args.max_minutes = args.dppo_env_steps, args.dppo_max_minutes
    if args.env_steps < 1 or args.dsrl_utd < 1 or args.dsrl_warmup_iterations < 0:
        parser.error("--env-steps and --dsrl-utd must be >= 1, --dsrl-warmup-iterations >= 0")
    if args.fpo_lr is not None and not args.fpo_lr > 0:
        parser.error(f"--fpo-lr must be > 0, got {args.fpo_lr}")
    return finish_args(args)


def plan(args) -> dict:
    """The budget every method gets, in env steps: whole iterations (the last one may overshoot ``--env-steps``) of
    num_envs episodes of min(n_steps x 4, max_episode_steps) env steps each (the envs reset at every iteration and
    an episode's last chunk stops at its time limit: 4 x 38 chunk steps of a 150-step Lift episode play 150)."""
    per_iteration = args.num_envs * min(args.n_steps * 4, args.max_episode_steps)
    iterations = max(1, math.ceil(args.env_steps / per_iteration))
    return {"iterations": iterations, "env_steps_per_iteration": per_iteration, "env_steps": iterations * per_iteration,
            "chunk_steps_per_env": iterations * args.n_steps}


def method_config(method: str, task: str) -> str:
    """The config ``method`` reads its settings from on ``task``: ``<method>_<task>.yaml`` where the repository has
    one (dppo_can.yaml), else ``<method>_lift.yaml``. The Lift settings stand for Can because the official Can configs
    repeat them: ReinFlow/ReinFlow cfg/robomimic/finetune/can/ft_ppo_reflow_mlp_img.yaml differs from the lift one
    only in n_train_itr (151 vs 81; the bench sets the budget), ajwagen/dsrl cfg/robomimic/dsrl_can.yaml from
    dsrl_lift.yaml only in utd (20 vs 30; the bench sets ``--dsrl-utd``), and FPO has no robomimic config."""
    from bench_finetuner_throughput import CONFIGS

    own = f"{method}_{task}.yaml"
    return own if (CONFIGS / own).is_file() else f"{method}_lift.yaml"


def module_settings(method: str, bc_ckpt: Path, args, seed: int) -> tuple[str, dict]:
    """(class path, init args) of ``method``'s fine-tuning module: its config's (:func:`method_config`), with the
    bench's env (num_envs, n_steps, episode length, subprocess envs), budget (:func:`plan`), seed, no in-run
    evaluation; DSRL's widths, utd, warm-up (in chunk steps per env: whole iterations) and a buffer that holds the
    whole run."""
    from mmpo.robotics.config import merged_settings

    class_path, init_args = model_init_args(method_config(method, args.task))
    budget = plan(args)
    overrides: dict = {"bc_checkpoint": str(bc_ckpt), "num_iterations": budget["iterations"], "env": rl_env(args),
                       "evaluation": {"every": 0}, "seed": seed}
    if method == "fpo" and args.fpo_lr is not None:
        overrides["optim"] = {"lr": args.fpo_lr}
    if method == "dsrl":
        overrides["dsrl"] = {"hidden_dims": list(args.dsrl_hidden), "utd": args.dsrl_utd,
                             "warmup_chunk_steps": args.dsrl_warmup_iterations * args.n_steps,
                             "buffer_size": budget["chunk_steps_per_env"] * args.num_envs}
    return class_path, merged_settings(init_args, overrides)


def settings_record(settings: dict) -> dict:
    """The settings a record stores: the module's init args but the BC path (in the record elsewhere)."""
    return {k: v for k, v in settings.items() if k != "bc_checkpoint"}


def train_flow_bc(seed: int, args, demos: Path, seed_dir: Path) -> tuple[Path, float]:
    """Flow-matching BC with the diffusion BC's recipe (``train_diffusion_bc``): (checkpoint, seconds)."""
    import lightning.pytorch as pl

    from mmpo.robotics.flow_bc import FlowBCModule

    spec = task_spec(args)
    pl.seed_everything(seed, verbose=False)
    bc = FlowBCModule(obs_dim=spec.obs_dim, action_dim=spec.action_dim, horizon=4, act_steps=4,
                      denoising_steps=args.flow_steps, hidden_dims=[args.hidden] * 3, lr=args.bc_lr,
                      lr_min=args.bc_lr / 10, warmup_steps=50, task=args.task,
                      max_episode_steps=args.max_episode_steps, export_safetensors=False)
    return fit_bc(bc, args, demos, seed_dir)


def eval_sampler(family_or_method: str, args):
    """The deterministic chain of an evaluation: DDIM eta = 0 (``--eval-sampler``) for the diffusion policies, the
    policy's own (noise-free Euler flow; DSRL: its mean noise through it) for the others."""
    return "args" if FAMILY.get(family_or_method, family_or_method) == "diffusion" else None


# ------------------------------------------------------------------------------------------------- the tasks
def bc_path(out_dir: Path, family: str, seed: int) -> Path:
    return out_dir / f"bc_{family}_seed{seed}.json"


def method_path(out_dir: Path, method: str, seed: int) -> Path:
    return out_dir / f"seed{seed}_{method}.json"


def tasks(args) -> list[tuple]:
    """Seed-major: ("bc", family, seed) for the BCs the methods need, then ("rl", method, seed)."""
    out = []
    for seed in args.seeds:
        out += [("bc", family, seed) for family in ("diffusion", "flow") if family in {FAMILY[m] for m in args.methods}]
        out += [("rl", method, seed) for method in args.methods]
    return out


def task_record_path(task: tuple, out_dir: Path) -> Path:
    kind, name, seed = task
    return bc_path(out_dir, name, seed) if kind == "bc" else method_path(out_dir, name, seed)


def task_status(task: tuple, out_dir: Path) -> str | None:
    path = task_record_path(task, out_dir)
    return json.loads(path.read_text()).get("status") if path.is_file() else None


def dependency(task: tuple) -> tuple | None:
    kind, name, seed = task
    return ("bc", FAMILY[name], seed) if kind == "rl" else None


def claim(out_dir: Path, task: tuple) -> bool:
    """Take ``task`` for this process (an exclusive claim file holding its pid); a claim whose process is gone is
    taken over. False when a live process holds it."""
    claims = out_dir / "claims"
    claims.mkdir(parents=True, exist_ok=True)
    path = claims / ("_".join(map(str, task)) + ".lock")
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(path.read_text() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and pid != os.getpid() and _alive(pid):
                return False
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as handle:
            handle.write(str(os.getpid()))
        return True
    return False


def release(out_dir: Path, task: tuple) -> None:
    (out_dir / "claims" / ("_".join(map(str, task)) + ".lock")).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def next_task(all_tasks: list[tuple], out_dir: Path) -> tuple[tuple | None, bool]:
    """(the first task not done whose BC is done, claimed for this process; whether any task is still pending).
    A task whose BC failed is dropped."""
    pending = False
    for task in all_tasks:
        if task_status(task, out_dir) in ("done", "failed"):
            continue
        dep = dependency(task)
        dep_status = task_status(dep, out_dir) if dep else "done"
        if dep_status == "failed":
            continue
        pending = True
        if dep_status == "done" and claim(out_dir, task):
            if task_status(task, out_dir) in ("done", "failed"):  # finished by another worker meanwhile
                release(out_dir, task)
                continue
            return task, True
    return None, pending


def run_bc(family: str, seed: int, args, demos: Path, out_dir: Path) -> dict:
    """Train one BC policy of ``seed`` and evaluate it once (the ``before`` of every method that starts from it)."""
    from mmpo.robotics.policy.io import load_policy

    path = bc_path(out_dir, family, seed)
    record = {"seed": seed, "family": family, "task": args.task, "status": "bc", "started": vs.utc_now(),
              "commit": vs.code_commit(), "demos": str(demos), "args": vars(args),
              "evaluation_modes": evaluation_modes(family)}
    atomic_write_json(path, record)
    if args.bc_from:
        ckpt, seconds, source = reused_bc(family, seed, args)
        record["bc_reused"] = {"from": str(bc_path(Path(args.bc_from), family, seed)), "commit": source["commit"]}
        if same_evaluation(source["args"], vars(args)):  # the same initial states and chain noise: copied
            record["bc_reused"]["evaluations_copied"] = [k for k in ("before", "before_stochastic") if k in source]
            record.update({k: source[k] for k in ("before", "before_episodes", "before_stochastic",
                                                  "before_stochastic_episodes") if k in source})
    else:
        seed_dir = out_dir / f"seed{seed}" / f"bc_{family}"
        seed_dir.mkdir(parents=True, exist_ok=True)
        train = train_diffusion_bc if family == "diffusion" else train_flow_bc
        ckpt, seconds = train(seed, args, demos, seed_dir)
    policy, metadata = load_policy(ckpt)
    if "before" not in record:
        print(f"[bc {family} s{seed}] " + ("reused" if args.bc_from else f"trained in {seconds:.0f}s") + "; evaluating",
              flush=True)
        episodes: list[dict] = []
        record["before"] = evaluate(policy, args, seed, metadata["normalizer_path"], episode_records=episodes,
                                    sampler=eval_sampler(family, args), seed_base=args.eval_seed_base)
        record["before_episodes"] = episodes
    record.update(bc_ckpt=str(ckpt), bc_seconds=seconds)
    if family == "flow" and any(m in STOCHASTIC for m in args.methods) and "before_stochastic" not in record:
        atomic_write_json(path, record)
        record.update(stochastic_evaluation(policy, args, seed, metadata["normalizer_path"], "before"))
    before = record["before"]
    record.update(status="done", finished=vs.utc_now())
    atomic_write_json(path, record)
    print(f"[bc {family} s{seed}] success {before['success_rate']:.3f} ({before['seconds']:.0f}s eval)", flush=True)
    return record


def reused_bc(family: str, seed: int, args) -> tuple[Path, float, dict]:
    """``--bc-from DIR``: (checkpoint, training seconds, record) of DIR's finished ``family`` BC of ``seed``."""
    source = bc_path(Path(args.bc_from), family, seed)
    if not source.is_file():
        raise FileNotFoundError(f"--bc-from: {source} does not exist")
    record = json.loads(source.read_text())
    if record.get("status") != "done" or record.get("task") != args.task:
        raise ValueError(f"--bc-from: {source} is not a finished {args.task} BC (status {record.get('status')}, "
                         f"task {record.get('task')})")
    return Path(record["bc_ckpt"]), record["bc_seconds"], record


def same_evaluation(theirs: dict, ours: dict) -> bool:
    """Whether two runs' evaluations meet the same initial states with the same chain noise (records from before
    ``--eval-seed-base`` used 100000)."""
    keys = ("eval_episodes", "num_envs", "max_episode_steps", "eval_sampler", "task")
    return (theirs.get("eval_seed_base", 100_000) == ours.get("eval_seed_base", 100_000)
            and all(theirs.get(k) == ours.get(k) for k in keys))


def stochastic_evaluation(policy, args, seed: int, normalizer_path: str, when: str) -> dict:
    """``<when>_stochastic`` and its episodes: ``evaluate`` with ``deterministic=False`` on the same envs, initial
    states and generator seed as the deterministic one (``EVALUATION_MODES`` says what it samples)."""
    episodes: list[dict] = []
    result = evaluate(policy, args, seed, normalizer_path, deterministic=False, episode_records=episodes,
                      sampler=None, seed_base=args.eval_seed_base)
    return {f"{when}_stochastic": result, f"{when}_stochastic_episodes": episodes}


def run_method(method: str, seed: int, args, out_dir: Path) -> dict:
    """Fine-tune ``method`` from its BC of ``seed`` for the planned budget (wall-capped), evaluate on the BC's
    episodes; the record is rewritten after every iteration."""
    from mmpo.robotics.policy.io import load_policy

    bc = json.loads(bc_path(out_dir, FAMILY[method], seed).read_text())
    seed_dir = out_dir / f"seed{seed}" / method
    seed_dir.mkdir(parents=True, exist_ok=True)
    path = method_path(out_dir, method, seed)
    class_path, settings = module_settings(method, Path(bc["bc_ckpt"]), args, seed)
    budget = plan(args)
    record = {"seed": seed, "method": method, "task": args.task, "status": "rl", "started": vs.utc_now(),
              "commit": vs.code_commit(), "demos": bc["demos"], "args": vars(args), "plan": budget,
              "rl_config": f"configs/robotics/{method_config(method, args.task)}",
              "rl_settings": settings_record(settings), "bc": {"record": str(bc_path(out_dir, FAMILY[method], seed)),
                                                               "ckpt": bc["bc_ckpt"], "commit": bc["commit"]},
              "before": bc["before"], "before_episodes": bc["before_episodes"], "bc_seconds": bc["bc_seconds"],
              "evaluation_modes": evaluation_modes(method), "curve": []}
    if method in STOCHASTIC and "before_stochastic" in bc:
        record.update(before_stochastic=bc["before_stochastic"],
                      before_stochastic_episodes=bc["before_stochastic_episodes"])
    atomic_write_json(path, record)
    # the networks the module builds (the critic, ReinFlow's noise net, DSRL's actor and critics) draw their initial
    # weights from the global RNG: seeded here, so a fine-tuning does not depend on what ran before it in the process
    import lightning.pytorch as pl

    pl.seed_everything(seed, verbose=False)
    module = _class(class_path)(**settings)
    record["_rl_start"] = time.perf_counter()
    ckpt, rl_seconds = fit_rl(module, args, seed_dir, vs.CurveRecorder(record, path), "rl.ckpt")
    del record["_rl_start"]
    policy, metadata = load_policy(ckpt)
    episodes: list[dict] = []
    record["after"] = evaluate(policy, args, seed, metadata["normalizer_path"], episode_records=episodes,
                               sampler=eval_sampler(method, args), seed_base=args.eval_seed_base)
    if method in STOCHASTIC:
        record["after_episodes"] = episodes
        atomic_write_json(path, record)
        record.update(stochastic_evaluation(policy, args, seed, metadata["normalizer_path"], "after"))
    last = record["curve"][-1] if record["curve"] else {}
    record.update(after_episodes=episodes, rl_seconds=rl_seconds, rl_iterations=len(record["curve"]),
                  env_steps=last.get("perf/env_steps_total", 0.0), faults=last.get("perf/faults", 0.0),
                  rollout_env_steps_per_s=float(np.mean([m["perf/env_steps_per_s"] for m in record["curve"]]))
                  if record["curve"] else 0.0,
                  cap_bound=len(record["curve"]) < budget["iterations"], status="done", finished=vs.utc_now())
    atomic_write_json(path, record)
    print(f"[{method} s{seed}] success {record['before']['success_rate']:.3f} -> {record['after']['success_rate']:.3f}"
          f", {record['env_steps']:.0f} env steps in {rl_seconds:.0f}s" + (" (wall cap bound)" if record["cap_bound"]
                                                                           else ""), flush=True)
    return record


def work(args, demos: Path, out_dir: Path) -> int:
    """Run tasks until none is left (waiting while another process trains a BC this one needs)."""
    all_tasks = tasks(args)
    while True:
        task, pending = next_task(all_tasks, out_dir)
        if task is None:
            if not pending:
                return 0
            time.sleep(args.poll_seconds)
            continue
        kind, name, seed = task
        try:
            if kind == "bc":
                run_bc(name, seed, args, demos, out_dir)
            else:
                run_method(name, seed, args, out_dir)
        except Exception as error:  # recorded; the other tasks go on
            path = task_record_path(task, out_dir)
            record = json.loads(path.read_text()) if path.is_file() else {"seed": seed}
            record.update(status="failed", error=f"{type(error).__name__}: {error}", finished=vs.utc_now())
            atomic_write_json(path, record)
            traceback.print_exc()
        finally:
            release(out_dir, task)


def stochastic_tasks(args, out_dir: Path) -> list[tuple[tuple, Path]]:
    """``--stochastic-only``: per seed, (task, record) for the flow BC's and then DSRL's missing stochastic
    evaluation, of the finished records of ``out_dir``."""
    out = []
    for seed in args.seeds:
        out.append((("stochastic", "flow", seed), bc_path(out_dir, "flow", seed)))
        out += [(("stochastic", method, seed), method_path(out_dir, method, seed)) for method in STOCHASTIC
                if method in args.methods]
    return out


def add_stochastic(args, out_dir: Path) -> int:
    """Add the stochastic evaluations missing from finished records (the flow BC's first, as DSRL's record pairs
    with it); several processes share the work through the claims."""
    from mmpo.robotics.policy.io import load_policy

    all_tasks = stochastic_tasks(args, out_dir)
    while True:
        pending, ran = False, False
        for task, path in all_tasks:
            _, name, seed = task
            when = "before" if name == "flow" else "after"
            record = json.loads(path.read_text()) if path.is_file() else {}
            if record.get("status") != "done" or (f"{when}_stochastic" in record and "before_stochastic" in record):
                continue
            pending = True
            bc = record if name == "flow" else json.loads(bc_path(out_dir, "flow", seed).read_text())
            if when == "after" and "before_stochastic" not in bc:
                continue  # the BC's comes first: DSRL's record pairs with it
            if not same_evaluation(record["args"], vars(args)):
                raise ValueError(f"{path} was evaluated on other episodes (--eval-episodes, --num-envs, "
                                 "--max-episode-steps, --eval-seed-base): give its run's options")
            if not claim(out_dir, task):
                continue
            try:
                record = json.loads(path.read_text())
                if f"{when}_stochastic" not in record:
                    ckpt = Path(record["bc_ckpt"]) if name == "flow" else out_dir / f"seed{seed}" / name / "rl.ckpt"
                    policy, metadata = load_policy(ckpt)
                    print(f"[stochastic {name} s{seed}] evaluating {ckpt}", flush=True)
                    record.update(stochastic_evaluation(policy, args, seed, metadata["normalizer_path"], when))
                    print(f"[stochastic {name} s{seed}] success {record[f'{when}_stochastic']['success_rate']:.3f} "
                          f"(deterministic {record[when]['success_rate']:.3f})", flush=True)
                if when == "after":
                    record.update(before_stochastic=bc["before_stochastic"],
                                  before_stochastic_episodes=bc["before_stochastic_episodes"])
                record["evaluation_modes"] = evaluation_modes(name)
                record.setdefault("stochastic_added", {"commit": vs.code_commit(), "at": vs.utc_now()})
                atomic_write_json(path, record)
                ran = True
            finally:
                release(out_dir, task)
        if not pending:
            return 0
        if not ran:
            time.sleep(args.poll_seconds)


# ----------------------------------------------------------------------------------------------- aggregation
def aggregate(records: list[dict], methods: tuple[str, ...] = METHODS, n_boot: int = 10_000) -> dict:
    """bench_dppo_vs_gaussian's per-method paired gains, plus each pair of methods' gain difference (A's gain - B's
    gain on the seeds where both finished; for two flow methods, whose BC is the same, it equals A's final - B's).
    A method of ``STOCHASTIC`` whose records hold the stochastic evaluations gets a second row, ``<method>_stochastic``:
    its stochastic evaluation paired with the flow BC's (:func:`stochastic_record`); the contrasts are between the
    deterministic rows."""
    extra = tuple(f"{m}_stochastic" for m in methods if m in STOCHASTIC)
    derived = [stochastic_record(r) for r in records if r["method"] in STOCHASTIC
               and {"before_stochastic_episodes", "after_stochastic_episodes"} <= set(r)]
    result = vs.aggregate(records + derived, n_boot=n_boot, methods=methods + extra)
    for a, b in combinations([m for m in result["methods"] if m in methods], 2):
        seeds, table = vs.paired_table(records, [a, b])
        if table:
            result["contrasts"][f"{a}_gain_minus_{b}_gain"] = {"seeds": seeds, **summarize_contrast(
                table, {f"{a}/after": 1.0, f"{a}/before": -1.0, f"{b}/after": -1.0, f"{b}/before": 1.0},
                n_boot=n_boot)}
    done = [r for r in records + derived if r.get("status") == "done"]
    for method, m in result["methods"].items():
        runs = sorted((r for r in done if r["method"] == method), key=lambda r: r["seed"])
        m["cap_bound"] = [bool(r.get("cap_bound")) for r in runs]
        m["planned_env_steps"] = [r.get("plan", {}).get("env_steps") for r in runs]
    return result


def stochastic_record(record: dict) -> dict:
    """A record's stochastic evaluations as a record of method ``<method>_stochastic`` (before: the flow BC's
    stochastic evaluation, after: the method's), for the aggregate."""
    return {**record, "method": f"{record['method']}_stochastic", "before": record["before_stochastic"],
            "after": record["after_stochastic"], "before_episodes": record["before_stochastic_episodes"],
            "after_episodes": record["after_stochastic_episodes"]}


def markdown(result: dict) -> str:
    interval = vs.interval
    lines = ["| method | seeds | episodes/seed | BC success per seed | fine-tuned per seed | mean BC -> fine-tuned "
             "| gain | 95% bootstrap (seeds x episodes) | 95% normal (episodes) | 95% t (seeds) | env steps/seed "
             "| RL wall s/seed | wall cap bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, m in result["methods"].items():
        if m["gain"] is None:
            continue
        lines.append(vs.method_cells(LABELS[method], m) +
                     f"{' / '.join('yes' if v else 'no' for v in m['cap_bound'])} |")
    for name, c in result["contrasts"].items():
        lines.append(f"| {name} | {', '.join(map(str, c['seeds']))} | | per seed "
                     f"{' / '.join(f'{v:+.2f}' for v in c['per_seed'])} | | | **{c['estimate']:+.3f}** | "
                     f"**{interval(c['bootstrap'])}** | {interval(c['episode_normal'])} | {interval(c['seed_t'])} | | | |")
    for u in result["unfinished"]:
        lines.append(f"\n- unfinished: {u['method']} seed {u['seed']} (status {u['status']}, "
                     f"{u['iterations']} RL iterations, {u['env_steps']:,.0f} env steps recorded)")
    lines.append(f"\n- task: {result['task']}")
    return "\n".join(lines)


def plot(records: list[dict], path: Path, methods: tuple[str, ...] = METHODS, window: int = 5) -> None:
    """Training-rollout success (stochastic, trailing mean of ``window`` iterations) vs env steps and vs RL wall
    seconds, per seed (thin) and the seeds' mean (thick); deterministic BC -> final per seed and mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mmpo.robotics.envs.tasks import get_task

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8), sharey=True)
    for method in methods:
        runs = sorted((r for r in records if r["method"] == method and r.get("curve")), key=lambda r: r["seed"])
        if not runs:
            continue
        color = COLORS[method]
        means = {"perf/env_steps_total": [], "perf/rl_wall_s": []}
        for r in runs:
            train = vs.smooth(np.array([m.get("charts/success_rate", np.nan) for m in r["curve"]]), window)
            for ax, key in zip(axes[:2], means):
                x = np.array([m.get(key, np.nan) for m in r["curve"]])
                ax.plot(x, train, color=color, alpha=0.3, lw=1)
                means[key].append((x, train))
        for ax, (key, curves) in zip(axes[:2], means.items()):
            length = max(c[0].size for c in curves)
            padded = np.full((2, len(curves), length), np.nan)
            for index, (x, y) in enumerate(curves):
                padded[0, index, :x.size], padded[1, index, :y.size] = x, y
            with np.errstate(invalid="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                ax.plot(np.nanmean(padded[0], axis=0), np.nanmean(padded[1], axis=0), color=color, lw=2.5,
                        label=f"{LABELS[method]} (mean of {len(runs)})")
        finished = [r for r in runs if r.get("status") == "done"]
        for r in finished:
            axes[2].plot([0.0, r["env_steps"]], [r["before"]["success_rate"], r["after"]["success_rate"]], color=color,
                         alpha=0.3, lw=1, marker="o", ms=4)
        if finished:
            axes[2].plot([0.0, np.mean([r["env_steps"] for r in finished])],
                         [np.mean([r["before"]["success_rate"] for r in finished]),
                          np.mean([r["after"]["success_rate"] for r in finished])], color=color, lw=2.5, marker="s",
                         label=f"{LABELS[method]}: BC -> final, {finished[0]['before']['episodes']:.0f} episodes "
                               f"(mean of {len(finished)} seeds)")
        sampled = [r for r in finished if method in STOCHASTIC and "after_stochastic" in r and "before_stochastic" in r]
        if sampled:  # the stochastic evaluation beside the deterministic one, dashed
            axes[2].plot([0.0, np.mean([r["env_steps"] for r in sampled])],
                         [np.mean([r["before_stochastic"]["success_rate"] for r in sampled]),
                          np.mean([r["after_stochastic"]["success_rate"] for r in sampled])], color=color, lw=2.5,
                         ls="--", marker="^", label=f"{LABELS[method]}: stochastic eval (mean of {len(sampled)} seeds)")
    axes[0].set(title=f"training-rollout success (stochastic), trailing mean of {window} iterations",
                xlabel="env steps", ylabel="success rate", ylim=(0, 1))
    axes[1].set(title="the same vs RL wall time (shared 2-core CPU)", xlabel="RL wall seconds")
    axes[2].set(title="deterministic eval (dashed: stochastic), paired episodes: BC -> final\nper seed (thin), mean "
                      "(thick)",
                xlabel="env steps")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=7)
    task = vs.records_task(records)
    fig.suptitle(f"robosuite {get_task(task).sim_name}: BC -> DPPO / ReinFlow / FPO / DSRL (same demos, same env-step "
                 "budget)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    if args.aggregate:
        records = vs.load_records(args.aggregate_dirs or [args.out_dir], METHODS)
        records = [r for r in records if r["method"] in args.methods and r["seed"] in args.seeds]
        result = aggregate(records, tuple(args.methods), n_boot=args.n_boot)
        block = markdown(result)
        print(block)
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out_dir / "aggregate.json", result)
        (out_dir / "aggregate.md").write_text(block + "\n")
        if args.plot:
            plot(records, Path(args.plot), tuple(args.methods))
            print(f"plot: {args.plot}")
        return 0
    import torch

    torch.set_num_threads(1)
    from mmpo.robotics.demos import generate_demos

    out_dir.mkdir(parents=True, exist_ok=True)
    demos = default_demos(args, out_dir)
    if not demos.exists():
        if not claim(out_dir, ("demos", "file", 0)):
            raise SystemExit(f"another process is writing {demos}: run --demos-only first, then the workers")
        try:
            stats = generate_demos(args.task, args.num_demos, demos, noise=args.noise, seed=1234, keep_failures=False)
        finally:
            release(out_dir, ("demos", "file", 0))
        print(f"demos: {demos} expert success {stats['success_rate']}", flush=True)
    check_demos(demos, args)
    if args.demos_only:
        return 0
    if args.stochastic_only:
        return add_stochastic(args, out_dir)
    budget = plan(args)
    print(f"budget per method: {budget['iterations']} iterations x {budget['env_steps_per_iteration']} = "
          f"{budget['env_steps']} env steps" + (f", capped at {args.max_minutes} min" if args.max_minutes else ""),
          flush=True)
    return work(args, demos, out_dir)


if __name__ == "__main__":
    sys.exit(main())
