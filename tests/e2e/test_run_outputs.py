"""What a run leaves a user to read (issue 36): the completions table, ``mmpo report``, a quiet console.

One real 2-step ``mmpo fit`` per family (VLM GRPO, dLLM diffu-GRPO, robot BC) feeds the tests.
"""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.loggers import WandbLogger

from mmpo.cli import main
from mmpo.eval.plots import read_csv_metrics
from mmpo.report import key_metrics, metric_group, read_tensorboard_scalars, summarise, write_report
from mmpo.training.completions import CSV_NAME, CompletionSamples, LogCompletions, sequence_advantages
from tiny_vlm_support import build_small_vlm, tiny_grpo_fit_args

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NOISE = ("💡", "Tip:", "litlogger", "litmodels", "GPU available: False", "TPU available: False", "Seed set to",
         "`Trainer.fit` stopped", "Loading weights", "Writing model shards", "args parameter is intended",
         "LeafSpec", "Epoch 0/")
COMPLETIONS = ["--trainer.callbacks+=mmpo.training.completions.LogCompletions",
               "--trainer.callbacks.every_n_steps=1", "--trainer.callbacks.max_rows=null"]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONWARNINGS", None)
    return env


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``mmpo fit -c configs/vlm/grpo_tiny.yaml`` for 2 steps in its own process, the completions logged every step."""
    root = tmp_path_factory.mktemp("vlm_run")
    tiny = build_small_vlm(root / "tiny")
    # the length reward is > 0 for any non-empty completion: the table's rewards and advantages are not all 0
    args = tiny_grpo_fit_args(REPO / "configs/vlm/grpo_tiny.yaml", tiny, root / "run",
                              "--model.init_args.rewards.weights={accuracy: 0.5, length: 0.5}")
    args.remove("--trainer.enable_progress_bar=false")  # the step bar is part of the console under test
    result = subprocess.run([sys.executable, "-m", "mmpo.cli", *args, *COMPLETIONS], cwd=root, env=_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "run", result


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_fit_console_has_no_noise(vlm_run):
    _, result = vlm_run
    console = result.stdout + result.stderr
    for noise in NOISE:
        assert noise not in console, noise
    assert "step 2/2" in result.stdout
    assert result.stderr.strip() == ""  # every line left on stderr was one of the notices above


def test_completions_table_matches_the_logged_rewards(vlm_run):
    run, _ = vlm_run
    (metrics_csv,) = run.glob("lightning_logs/version_*/metrics.csv")
    table = _csv_rows(metrics_csv.parent / CSV_NAME)
    assert list(table[0]) == ["step", "prompt", "completion", "reward/accuracy", "reward/length", "reward",
                              "advantage"]
    assert any(float(r["reward"]) > 0 for r in table)
    curves = read_csv_metrics(metrics_csv)
    steps = sorted({int(r["step"]) for r in table})
    assert steps == [0, 1]  # one table per optimizer step (every_n_steps=1)
    for step in steps:
        rows = [r for r in table if int(r["step"]) == step]
        assert len(rows) == 4  # 2 prompts x G = 2, all of them (max_rows=null)
        logged = {name: dict(points) for name, points in curves.items()}  # a step's metrics are logged at its step
        for column, metric in (("reward", "rewards/total/mean"), ("reward/accuracy", "rewards/accuracy/mean"),
                               ("reward/length", "rewards/length/mean")):
            mean = sum(float(r[column]) for r in rows) / len(rows)
            assert mean == pytest.approx(logged[metric][step], rel=1e-5)
        for r in rows:  # total = 0.5 accuracy + 0.5 length (the weights given)
            assert float(r["reward"]) == pytest.approx(0.5 * float(r["reward/accuracy"]) + 0.5 * float(r["reward/length"]))
        # each prompt's G completions sit together, and GRPO's advantages sum to 0 over the group
        assert rows[0]["prompt"] == rows[1]["prompt"] and rows[2]["prompt"] == rows[3]["prompt"]
        assert rows[0]["prompt"] and rows[0]["prompt"] != rows[2]["prompt"]
        for group in (rows[:2], rows[2:]):
            assert sum(float(r["advantage"]) for r in group) == pytest.approx(0.0, abs=1e-5)


def _check_report(run: Path, curves: dict[str, list[tuple[int, float]]]) -> str:
    plots, summary = write_report(run)
    groups = {metric_group(name) for name in curves}
    assert sorted(p.stem for p in plots) == sorted(groups)
    for plot in plots:
        assert plot.read_bytes()[:8] == PNG_MAGIC and plot.stat().st_size > 1000
    text = summary.read_text()
    steps = sorted({s for points in curves.values() for s, _ in points})
    assert f"- steps logged: {len(steps)}; last step: {steps[-1]}" in text
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
             if line.startswith("| ") and not line.startswith("| metric")]
    rows = {row[0]: row for row in cells}
    key = key_metrics(curves)
    assert list(rows) == key and key
    for name in key:
        finite = [(s, v) for s, v in curves[name] if math.isfinite(v)]
        _, first, last, best, best_step = rows[name]
        assert float(first) == pytest.approx(finite[0][1], rel=1e-5)
        assert float(last) == pytest.approx(finite[-1][1], rel=1e-5)
        if best:
            values = [v for _, v in finite]
            expected = max(values) if summarise(name, finite).best == max(values) else min(values)
            assert float(best) == pytest.approx(expected, rel=1e-5)
            assert int(best_step) == next(s for s, v in finite if v == expected)
    return text


def test_report_of_the_vlm_run(vlm_run, capsys):
    run, _ = vlm_run
    (metrics_csv,) = run.glob("lightning_logs/version_*/metrics.csv")
    curves = {k: v for k, v in read_csv_metrics(metrics_csv).items()}
    text = _check_report(run, curves)
    assert "| rewards/total/mean |" in text and "| policy/approx_kl |" in text
    assert main(["report", str(run)]) == 0  # the command prints the same summary
    assert capsys.readouterr().out.startswith(text.rstrip("\n"))


def test_report_of_a_dllm_run_reads_tensorboard(tmp_path, monkeypatch):
    """configs/dllm/grpo_tiny.yaml names no logger: Lightning's TensorBoardLogger writes event files."""
    from mmpo.dllm.warmup import ensure_warm_model

    monkeypatch.chdir(REPO)
    tiny = ["--model.init_args.tiny.hidden_size=32", "--model.init_args.tiny.num_layers=1",
            "--model.init_args.tiny.num_heads=2", "--model.init_args.tiny.intermediate_size=64"]
    data = ["--data.init_args.train_size=64", "--data.init_args.test_size=8", "--data.init_args.val_size=4"]
    warm = ensure_warm_model(tmp_path / "sft" / "model", REPO / "configs/dllm/sft_tiny.yaml",
                             ["--trainer.max_steps=1", "--data.init_args.batch_size=4", "--trainer.logger=false",
                              f"--trainer.callbacks.init_args.dirpath={tmp_path / 'sft_ckpt'}",
                              "--trainer.enable_progress_bar=false", *tiny, *data])
    run = tmp_path / "grpo"
    assert main(["fit", "-c", str(REPO / "configs/dllm/grpo_tiny.yaml"), f"--model.init_args.model_path={warm}",
                 "--model.init_args.warmup_config=null", f"--model.init_args.save_dir={run / 'model'}",
                 f"--trainer.default_root_dir={run}", f"--trainer.callbacks.init_args.dirpath={run / 'ckpt'}",
                 "--model.init_args.group_size=2", "--model.init_args.optim.mu=1",
                 "--model.init_args.sampler.gen_length=8", "--model.init_args.sampler.steps=4",
                 "--model.init_args.sampler.block_length=8",
                 "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
                 "--data.init_args.batch_size=2", *data, *COMPLETIONS]) == 0
    events = sorted(run.rglob("events.out.tfevents.*"))
    assert events and not list(run.rglob("metrics.csv"))
    curves = {k: v for k, v in read_tensorboard_scalars(events).items() if k not in ("epoch", "hp_metric")}
    _check_report(run, curves)
    # the completions went to the CSV beside the event files: 2 prompts x 2 per step, rewards as logged
    table = _csv_rows(events[0].parent / CSV_NAME)
    assert [int(r["step"]) for r in table] == [0] * 4 + [1] * 4
    assert list(table[0])[3:] == ["reward/correct", "reward", "advantage"]
    logged = dict(curves["rewards/total/mean"])
    for step in (0, 1):
        rows = [r for r in table if int(r["step"]) == step]
        assert sum(float(r["reward"]) for r in rows) / 4 == pytest.approx(logged[step])
    # ... and to TensorBoard as text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(events[0]), size_guidance={"tensors": 0})
    accumulator.Reload()
    assert any(tag.startswith("completions") for tag in accumulator.Tags()["tensors"])


def test_report_of_a_robot_bc_run(tmp_path):
    from golden_support import load_script

    demos = load_script(REPO / "tests/reliability/test_resume_robotics.py").write_tiny_demos(tmp_path / "lift.hdf5")
    run = tmp_path / "bc"
    assert main(["fit", "-c", str(REPO / "configs/robotics/bc_lift.yaml"), "--data.init_args.dataset_path", str(demos),
                 "--data.init_args.batch_size", "8", "--model.init_args.hidden_dims", "[16, 16, 16]",
                 "--model.init_args.denoising_steps", "5", "--model.init_args.export_safetensors", "false",
                 "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
                 "--trainer.default_root_dir", str(run), "--trainer.logger.init_args.save_dir", str(run),
                 "--trainer.callbacks.init_args.dirpath", str(run / "checkpoints")]) == 0
    (metrics_csv,) = run.rglob("metrics.csv")
    text = _check_report(run, read_csv_metrics(metrics_csv))
    assert "| losses/bc_step |" in text and "| losses/bc_epoch |" in text


def test_report_without_logs_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"mmpo report: error: no metrics.csv or TensorBoard event file under {tmp_path} (was the run's logger disabled?)"


class _FakeWandb(WandbLogger):
    """A WandbLogger that never starts wandb: records ``log_table`` calls."""

    def __init__(self) -> None:  # no super().__init__: that needs the wandb package and a run
        self.tables: list[dict] = []

    def log_table(self, key, columns=None, data=None, dataframe=None, step=None) -> None:
        self.tables.append({"key": key, "columns": columns, "data": data, "step": step})


def test_log_completions_writes_csv_wandb_and_console(tmp_path, capsys):
    import torch

    samples = CompletionSamples.build(
        3, ["p0", "p0", "p1", "p1"], ["a", "b|c", "d\ne", "f"], torch.tensor([1.0, 0.0, 0.5, 0.5]),
        {"accuracy": torch.tensor([1.0, 0.0, 0.0, 0.0]), "user.py:fn": [None, 1.0, 1.0, 1.0]},
        torch.tensor([[1.0, 3.0], [-1.0, -1.0], [2.0, 0.0], [0.0, 0.0]]), torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1]]))
    assert samples.advantages == [2.0, -1.0, 2.0, 0.0]  # token advantages averaged over each completion's mask
    wandb = _FakeWandb()
    trainer = SimpleNamespace(loggers=[wandb], log_dir=str(tmp_path), default_root_dir=str(tmp_path), global_rank=0)
    callback = LogCompletions(every_n_steps=2, max_rows=3, console=True)
    module = SimpleNamespace(completion_samples=samples)
    callback.on_train_batch_end(trainer, module, None, None, 0)
    callback.on_train_batch_end(trainer, module, None, None, 1)  # the same step again: logged once
    columns = ["step", "prompt", "completion", "reward/accuracy", "reward/user.py:fn", "reward", "advantage"]
    (table,) = wandb.tables
    assert math.isnan(table["data"][0][4])  # the user function's None for completion 0
    table["data"][0][4] = None
    assert table == {"key": "completions", "columns": columns, "step": 3, "data": [
        [3, "p0", "a", 1.0, None, 1.0, 2.0], [3, "p0", "b|c", 0.0, 1.0, 0.0, -1.0],
        [3, "p1", "d\ne", 0.0, 1.0, 0.5, 2.0]]}
    rows = _csv_rows(tmp_path / CSV_NAME)
    assert [r["completion"] for r in rows] == ["a", "b|c", "d\ne"] and rows[0]["reward/user.py:fn"] == "nan"
    assert "completions at step 3" in capsys.readouterr().out
    # 3 -> 4 crosses a multiple of 2 (logged), 4 -> 5 does not
    callback.on_train_batch_end(trainer, SimpleNamespace(completion_samples=_at(samples, 4)), None, None, 2)
    callback.on_train_batch_end(trainer, SimpleNamespace(completion_samples=_at(samples, 5)), None, None, 3)
    assert [t["step"] for t in wandb.tables] == [3, 4]
    assert [int(r["step"]) for r in _csv_rows(tmp_path / CSV_NAME)] == [3, 3, 3, 4, 4, 4]


def _at(samples: CompletionSamples, step: int) -> CompletionSamples:
    return CompletionSamples(step, samples.prompts, samples.completions, samples.rewards, samples.advantages)


def test_sequence_advantages_and_bad_settings():
    import torch

    assert sequence_advantages(torch.tensor([0.5, -0.5])) == [0.5, -0.5]
    with pytest.raises(ValueError, match="every_n_steps must be >= 1, got 0"):
        LogCompletions(every_n_steps=0)
    with pytest.raises(ValueError, match="unequal lengths"):
        CompletionSamples.build(0, ["p"], ["a", "b"], torch.tensor([1.0, 0.0]), {}, torch.tensor([0.0, 0.0]))
