"""Golden short runs of every family's tiny config through `mmpo fit` (CPU, one thread).

Each family runs 2-3 optimizer steps of its tiny YAML config at a tiny size, and the per-step metrics
of Lightning's CSV log (losses, rewards, grad norm, clipfrac, ...; timing metrics excluded) are the
result. ``tests/reliability/test_golden_runs.py`` reruns this and compares with the committed
``golden_runs.json``, so a silent change of the numerics fails CI.

    # rewrite the artifact on purpose (then update bench/RESULTS.md: its recorded numbers moved too)
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python tests/reliability/golden_runs/make_golden_runs.py --write
    # print / save the current metrics without touching the artifact
    OMP_NUM_THREADS=1 python tests/reliability/golden_runs/make_golden_runs.py --out /tmp/now.json
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
from mmpo.training.machine import PORTABLE_CPU_NUMERICS  # noqa: E402  (torch-free import)

# one thread and the AVX2 code paths before torch is imported: multi-threaded reductions and the SIMD level
# change the last bits of the sums (mmpo/training/machine.py)
os.environ.update(PORTABLE_CPU_NUMERICS)
ARTIFACT = Path(__file__).resolve().parent / "golden_runs.json"
REGENERATE = "OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python tests/reliability/golden_runs/make_golden_runs.py --write"
# wall-clock metrics: they differ between any two runs, so they are not pinned
TIMING = re.compile(r"^perf/.*(_s|tokens_per_s|steps_per_s)$")
# CSV columns that are bookkeeping, not numerics
BOOKKEEPING = {"step", "epoch"}


def read_metrics(log_root: Path) -> dict[str, dict[str, float]]:
    """{str(step): {metric: value}} from the one metrics.csv under ``log_root``; rows of one step merged,
    timing metrics dropped; NaN kept as the string "nan" so JSON round-trips it."""
    (path,) = sorted(log_root.rglob("metrics.csv"))
    steps: dict[str, dict[str, float]] = {}
    with open(path) as handle:
        for row in csv.DictReader(handle):
            merged = steps.setdefault(row["step"], {})
            for key, value in row.items():
                if value in ("", None) or key in BOOKKEEPING or TIMING.match(key):
                    continue
                merged[key] = float(value)
    return steps


def _logger(root: Path) -> list[str]:
    return ["--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.init_args.save_dir={root}",
            f"--trainer.default_root_dir={root}", f"--trainer.callbacks.init_args.dirpath={root / 'ckpt'}",
            "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1"]


def _fit(config: str, root: Path, *extra: str) -> dict[str, dict[str, float]]:
    from mmpo.cli import main

    assert main(["fit", "-c", str(REPO / config), *_logger(root), *extra]) in (0, None)
    return read_metrics(root)


def vlm_runs(work: Path) -> dict[str, dict[str, dict[str, float]]]:
    """`mmpo build-tiny` (a very small Qwen2.5-VL), SFT 3 steps, then GRPO 2 steps from the SFT weights."""
    from mmpo.cli import main

    base = work / "vlm_base"
    assert main(["build-tiny", "--out", str(base), "--vocab-size", "400", "--hidden-size", "32", "--num-layers", "1",
                 "--num-heads", "2", "--num-kv-heads", "1", "--intermediate-size", "64", "--vision-hidden-size", "32",
                 "--vision-heads", "2", "--vision-intermediate-size", "64"]) in (0, None)
    data = ["--data.init_args.tasks=[count_shapes,arithmetic]", "--data.init_args.train_size=8",
            "--data.init_args.val_size=2", "--data.init_args.batch_size=2", "--trainer.val_check_interval=1000",
            "--trainer.limit_val_batches=0"]
    sft = _fit("configs/vlm/sft_tiny.yaml", work / "vlm_sft", *data, "--trainer.max_steps=3",
               f"--model.init_args.model_path={base}", f"--model.init_args.output_dir={work / 'vlm_sft_hf'}",
               "--model.init_args.optim.warmup_steps=1")
    grpo = _fit("configs/vlm/grpo_tiny.yaml", work / "vlm_grpo", *data, "--trainer.max_steps=2",
                f"--model.init_args.model_path={work / 'vlm_sft_hf'}",
                f"--model.init_args.output_dir={work / 'vlm_grpo_hf'}",
                "--model.init_args.sampling.num_generations=4", "--model.init_args.sampling.max_new_tokens=8",
                # accuracy and format are 0 at this size; the example brevity reward (1 / (1 + words) on easy items)
                # varies within a group, so the policy loss is not 0; KL and entropy terms move the gradient too
                '--model.init_args.rewards.weights={"accuracy": 0.9, "format": 0.1, '
                '"examples/rewards.py:brevity_when_easy": 1.0}',
                "--model.init_args.loss.beta=0.01", "--model.init_args.loss.entropy_coef=0.01")
    return {"vlm/sft_tiny": sft, "vlm/grpo_tiny": grpo}


DLLM_TINY = ["--model.init_args.tiny.hidden_size=32", "--model.init_args.tiny.num_layers=1",
             "--model.init_args.tiny.num_heads=2", "--model.init_args.tiny.intermediate_size=64"]
DLLM_DATA = ["--data.init_args.train_size=32", "--data.init_args.test_size=8", "--data.init_args.val_size=4"]


def dllm_runs(work: Path) -> dict[str, dict[str, dict[str, float]]]:
    """SFT 3 steps at a tiny size (the warm model), then diffu-GRPO and IGPO 4 optimizer steps each
    (2 batches x 2 inner updates)."""
    warm = work / "dllm_sft" / "model"
    sft = _fit("configs/dllm/sft_tiny.yaml", work / "dllm_sft", "--trainer.max_steps=3",
               "--data.init_args.batch_size=8",
               f"--model.init_args.save_dir={warm}", "--trainer.val_check_interval=1000", *DLLM_TINY, *DLLM_DATA)
    results = {"dllm/sft_tiny": sft}
    # IGPO: hints that reveal the whole reasoning trace (answer included), so hinted groups are correct, replace
    # the all-wrong ones and the IGPO loss path gets a non-zero signal at this size (every sampled answer is wrong)
    full_hints = {"grpo_tiny": [], "igpo_tiny": [
        "--model.init_args.hints.eta_low=1.0", "--model.init_args.hints.eta_high=1.0",
        "--model.init_args.hints.trace_free_tail=0", "--model.init_args.hints.free_tail=0"]}
    for name in ("grpo_tiny", "igpo_tiny"):
        root = work / f"dllm_{name}"
        results[f"dllm/{name}"] = _fit(
            f"configs/dllm/{name}.yaml", root, f"--model.init_args.model_path={warm}",
            "--model.init_args.warmup_config=null",
            f"--model.init_args.save_dir={root / 'model'}", "--model.init_args.group_size=4",
            "--model.init_args.sampler.gen_length=24", "--model.init_args.sampler.steps=6",
            "--model.init_args.sampler.block_length=8", "--trainer.max_steps=4",
            "--trainer.val_check_interval=1000",
            "--data.init_args.batch_size=2", *DLLM_DATA, *full_hints[name])
    return results


def robotics_runs(work: Path) -> dict[str, dict[str, dict[str, float]]]:
    """BC 3 steps on tiny synthetic Lift-shaped demos (configs/robotics/bc_lift.yaml), then DPPO 3 iterations
    (configs/robotics/dppo_lift.yaml) on in-process Hopper envs from a seeded tiny BC policy."""
    import torch

    sys.path.insert(0, str(REPO / "tests" / "reliability"))
    from test_resume_robotics import write_tiny_demos  # the resume tests' demos: same layout, seeded

    from mmpo.robotics.bc import BCModule

    demos = write_tiny_demos(work / "lift.hdf5")
    bc = _fit("configs/robotics/bc_lift.yaml", work / "bc", f"--data.init_args.dataset_path={demos}",
              "--data.init_args.batch_size=16", "--model.init_args.hidden_dims=[16, 16, 16]",
              "--model.init_args.denoising_steps=5", "--model.init_args.warmup_steps=1",
              "--model.init_args.export_safetensors=false", "--trainer.max_steps=3")
    torch.manual_seed(0)
    policy = BCModule(obs_dim=11, action_dim=3, horizon=2, act_steps=2, denoising_steps=3, hidden_dims=[8, 8, 8],
                      export_safetensors=False, task="hopper")
    checkpoint = work / "hopper_bc.ckpt"
    torch.save({"state_dict": policy.state_dict(), "robotics": policy.robotics_metadata()}, checkpoint)
    dppo = _fit("configs/robotics/dppo_lift.yaml", work / "dppo", f"--model.init_args.bc_checkpoint={checkpoint}",
                "--model.init_args.env.task=hopper", "--model.init_args.num_iterations=3", "--model.init_args.env.num_envs=2",
                "--model.init_args.env.n_steps=3", "--model.init_args.env.max_episode_steps=8", "--model.init_args.chain.ft_steps=2",
                "--model.init_args.optim.minibatch_size=6", "--model.init_args.optim.mu=1",
                "--model.init_args.critic.warmup_iterations=1", "--model.init_args.evaluation.every=2",
                "--model.init_args.evaluation.episodes=2", "--model.init_args.critic.hidden_dims=[8]",
                "--model.init_args.env.asynchronous=false")
    return {"robotics/bc_lift": bc, "robotics/dppo_lift": dppo}


FAMILIES = {"vlm": vlm_runs, "dllm": dllm_runs, "robotics": robotics_runs}


def run_all(families: list[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    import torch

    torch.set_num_threads(1)
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in families or list(FAMILIES):
            work = Path(tmp) / name
            work.mkdir()
            results.update(FAMILIES[name](work))
    return results


def _jsonable(results: dict) -> dict:
    return {run: {step: {k: ("nan" if math.isnan(v) else v) for k, v in sorted(metrics.items())}
                  for step, metrics in steps.items()} for run, steps in results.items()}


def _write_atomic(path: Path, payload: dict) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    os.replace(temporary, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--write", action="store_true", help=f"rewrite {ARTIFACT.name} (on purpose only)")
    target.add_argument("--out", type=Path, help="write the current metrics here instead")
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=None)
    args = parser.parse_args(argv)
    os.chdir(REPO)  # the configs' relative defaults (runs/...) are overridden, but keep them inside the repo
    from mmpo.training.machine import cpu_fingerprint

    payload = {"command": REGENERATE, "machine": cpu_fingerprint(), "runs": _jsonable(run_all(args.families))}
    _write_atomic(ARTIFACT if args.write else args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
