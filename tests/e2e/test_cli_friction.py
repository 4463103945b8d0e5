"""The friction items of issue 15, section 4: what a new user meets first on the command line.

``mmpo --version``; ``mmpo build-tiny``; ``mmpo fit``'s console (no Lightning notices, a
``step k/max_steps`` bar with an ETA and a few metrics); ``mmpo eval``'s usage and pixel flags;
integer step ticks on learning curves; the README agreeing with the configs and the quickstart.
"""

from __future__ import annotations

import csv
import logging
import os
import re
import subprocess
import sys
import warnings
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

from mmpo.cli import main
from mmpo.training.cli_support import MMPOLightningCLI
from mmpo.training.progress import StepProgressBar, chosen_metrics, step_description
from mmpo.training.quiet import RANK_ZERO_LOGGERS, quiet_lightning_notices

REPO = Path(__file__).resolve().parents[2]
BORING = ["--model", "lightning.pytorch.demos.boring_classes.BoringModel",
          "--data", "lightning.pytorch.demos.boring_classes.BoringDataModule"]
TINY_SIZES = ["--vocab-size", "400", "--hidden-size", "32", "--intermediate-size", "64",
              "--vision-hidden-size", "32", "--vision-intermediate-size", "64"]


# ----------------------------------------------------------------------------- mmpo --version


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag_prints_the_installed_version(flag, capsys):
    assert main([flag]) == 0
    assert capsys.readouterr().out.strip() == f"mmpo {version('mmpo')}"


def test_usage_names_the_version_flag_and_build_tiny(capsys):
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert "mmpo --version" in usage and "build-tiny" in usage


# ----------------------------------------------------------------------------- progress bar


def test_step_description_and_chosen_metrics():
    assert step_description(3, 400) == "step 3/400"
    assert step_description(3, None) == "step 3"
    metrics = {"v_num": 0, "loss": 6.4712, "val/accuracy": 0.2731, "val/format": 1, "val/loss": 6.275,
               "lr": 1e-5, "note": "text"}
    assert chosen_metrics(metrics, None, 4) == {"loss": "6.471", "val/accuracy": "0.2731", "val/format": "1",
                                                "val/loss": "6.275"}
    assert chosen_metrics(metrics, ["lr", "missing", "loss"], 4) == {"lr": "1e-05", "loss": "6.471"}


class _SixMetrics(BoringModel):
    """Logs six progress-bar metrics per step (more than the bar shows)."""

    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        for index in range(6):
            self.log(f"m{index}", float(index + batch_idx), prog_bar=True, on_step=True, on_epoch=False)
        return output


def test_step_progress_bar_over_a_max_steps_fit(tmp_path, capsys):
    """A 5-step fit over 64-batch epochs: ``step 5/5`` with an ETA, 4 metrics, no epoch counter."""
    bar = StepProgressBar(max_metrics=4)
    trainer = Trainer(accelerator="cpu", max_steps=5, callbacks=[bar], logger=False, enable_checkpointing=False,
                      enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(_SixMetrics(), datamodule=BoringDataModule())
    assert trainer.global_step == 5
    assert bar.description(trainer) == "step 5/5"
    assert bar.get_metrics(trainer, trainer.lightning_module) == {"m0": "4", "m1": "5", "m2": "6", "m3": "7"}
    lines = [line.strip() for line in capsys.readouterr().out.replace("\r", "\n").splitlines() if line.strip()]
    assert re.fullmatch(r"step 5/5: \|█+\| \[\d\d:\d\d<00:00, [\d.]+ ?(step/s|s/step), m0=4, m1=5, m2=6, m3=7\]",
                        lines[-1]), lines[-1]
    assert lines[0].startswith("step 0/5: |")  # the first line already counts steps
    assert not any("Epoch" in line or "Training" in line or "m4" in line for line in lines)


def test_step_progress_bar_resumes_at_the_restored_step(tmp_path, capsys):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def trainer(max_steps: int) -> Trainer:
        return Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_model_summary=False,
                       limit_val_batches=0, default_root_dir=tmp_path,
                       callbacks=[StepProgressBar(), ModelCheckpoint(dirpath=tmp_path, save_last=True)])

    trainer(3).fit(BoringModel(), datamodule=BoringDataModule())
    capsys.readouterr()
    resumed = trainer(5)
    resumed.fit(BoringModel(), datamodule=BoringDataModule(), ckpt_path=tmp_path / "last.ckpt")
    lines = [line.strip() for line in capsys.readouterr().out.replace("\r", "\n").splitlines() if line.strip()]
    assert lines[0].startswith("step 3/5: |") and lines[-1].startswith("step 5/5: |")


def _cli_trainer(tmp_path: Path, *extra: str) -> Trainer:
    quiet_lightning_notices()  # args given inside pytest: Lightning's args-vs-sys.argv warning is expected
    cli = MMPOLightningCLI(BoringModel, BoringDataModule, run=False,
                           args=["--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}", *extra])
    return cli.trainer


def test_cli_installs_the_step_bar_unless_one_is_configured(tmp_path):
    assert type(_cli_trainer(tmp_path).progress_bar_callback) is StepProgressBar
    configured = _cli_trainer(tmp_path, "--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar",
                              "--trainer.callbacks.refresh_rate=7")
    bars = [cb for cb in configured.callbacks if isinstance(cb, TQDMProgressBar)]
    assert len(bars) == 1 and type(bars[0]) is TQDMProgressBar and bars[0].refresh_rate == 7
    assert _cli_trainer(tmp_path, "--trainer.enable_progress_bar=false").progress_bar_callback is None


def test_mmpo_fit_console_is_quiet_and_counts_steps(tmp_path):
    """A real ``mmpo fit``: none of Lightning's notices, and the step bar instead of ``Epoch 0/-2``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONWARNINGS", None)
    result = subprocess.run(
        [sys.executable, "-m", "mmpo.cli", "fit", *BORING, "--seed_everything=0", "--trainer.accelerator=cpu",
         "--trainer.max_steps=3", "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={tmp_path}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    console = result.stdout + result.stderr
    for noise in ("args parameter is intended", "LeafSpec", "litlogger", "litmodels", "Epoch 0/"):
        assert noise not in console, noise
    assert "step 3/3" in console


def test_quiet_filters_are_message_specific():
    from lightning.pytorch.utilities._pytree import _tree_flatten

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_lightning_notices()
        _tree_flatten(torch.utils.data.DataLoader([1, 2]))  # Lightning's own LeafSpec use
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated (from user code)", FutureWarning)
        warnings.warn("some other deprecation", FutureWarning)
    # the same text raised from any module other than Lightning's _pytree still shows
    assert [str(w.message) for w in caught] == ["`isinstance(treespec, LeafSpec)` is deprecated (from user code)",
                                                "some other deprecation"]
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        tip = logger.makeRecord(name, logging.INFO, __file__, 1, "💡 Tip: For seamless cloud logging and experiment "
                                "tracking, try installing [litlogger](https://pypi.org/project/litlogger/)", (), None)
        no_gpu = logger.makeRecord(name, logging.INFO, __file__, 1, "GPU available: False, used: False", (), None)
        info = logger.makeRecord(name, logging.INFO, __file__, 1, "GPU available: True (cuda), used: True", (), None)
        assert not logger.filter(tip) and not logger.filter(no_gpu) and logger.filter(info)
    seed = logging.getLogger("lightning.fabric.utilities.seed")
    assert not seed.filter(seed.makeRecord(seed.name, logging.INFO, __file__, 1, "Seed set to 0", (), None))
    assert seed.filter(seed.makeRecord(seed.name, logging.INFO, __file__, 1, "another line", (), None))


# ----------------------------------------------------------------------------- mmpo build-tiny


@pytest.fixture(scope="module")
def built_tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("build_tiny") / "base"
    assert main(["build-tiny", "--out", str(out), *TINY_SIZES]) == 0
    return out


def test_build_tiny_writes_the_sizes_asked_and_keeps_an_existing_out(built_tiny, capsys):
    config = yaml.safe_load((built_tiny / "config.json").read_text())  # JSON is YAML
    text = config.get("text_config", config)
    assert (text["hidden_size"], text["intermediate_size"], text["vocab_size"]) == (32, 64, 400)
    assert config["vision_config"]["hidden_size"] == 32
    before = (built_tiny / "model.safetensors").read_bytes()
    assert main(["build-tiny", "--out", str(built_tiny), *TINY_SIZES, "--hidden-size", "64"]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (built_tiny / "model.safetensors").read_bytes() == before
    assert not [p for p in built_tiny.parent.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_build_tiny_output_fits_the_tiny_sft_config(built_tiny, tmp_path):
    run = tmp_path / "sft"
    assert main([
        "fit", "-c", str(REPO / "configs" / "vlm" / "sft_tiny.yaml"),
        f"--model.init_args.model_path={built_tiny}", f"--model.init_args.output_dir={run / 'hf'}",
        f"--trainer.default_root_dir={run}", f"--trainer.logger.init_args.save_dir={run}",
        f"--trainer.callbacks.init_args.dirpath={run / 'ckpt'}", "--trainer.max_steps=1",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false", "--data.init_args.tasks=[count_shapes]",
        "--data.init_args.train_size=4", "--data.init_args.val_size=2", "--data.init_args.batch_size=2",
    ]) == 0
    (metrics,) = run.glob("**/metrics.csv")
    losses = [float(row["loss"]) for row in csv.DictReader(metrics.open()) if row.get("loss")]
    assert len(losses) == 1 and losses[0] > 0
    assert (run / "hf" / "config.json").is_file()


# ----------------------------------------------------------------------------- mmpo eval


def test_eval_usage_shows_list_and_explains_its_defaults(capsys):
    from mmpo.eval.cli import build_parser

    parser = build_parser()
    assert "mmpo eval --list" in parser.format_usage()
    help_text = " ".join(parser.format_help().split())
    assert "default float32, the training modules' default dtype too" in help_text
    assert "default 128: above the tiny configs' training budget" in help_text


def test_eval_pixel_flags_reach_the_processor(built_tiny, tmp_path, monkeypatch):
    import mmpo.vlm.factory as factory
    from mmpo.vlm.factory import pixel_budget

    loaded = []
    real_load_vlm = factory.load_vlm

    def spy(*args, **kwargs):
        model, processor = real_load_vlm(*args, **kwargs)
        loaded.append(processor)
        return model, processor

    monkeypatch.setattr(factory, "load_vlm", spy)
    assert main(["eval", "--model", str(built_tiny), "--benchmarks", "synth/count_shapes", "--limit", "1",
                 "--max-new-tokens", "2", "--min-pixels", "1568", "--max-pixels", "6272", "--no-progress",
                 "--out", str(tmp_path / "eval")]) == 0
    assert [pixel_budget(processor) for processor in loaded] == [(1568, 6272)]


# ----------------------------------------------------------------------------- plots and docs


def test_learning_curve_ticks_are_whole_steps(tmp_path, monkeypatch):
    from mmpo.eval import plots

    metrics = tmp_path / "metrics.csv"
    metrics.write_text("step,rewards/total/mean\n0,0.1\n1,0.3\n2,0.2\n")
    figures = []
    monkeypatch.setattr(plots.plt, "close", figures.append)  # keep the figure to read its axes
    plots.plot_curves(metrics, ["rewards/total/mean"], tmp_path / "curve.png")
    axes = figures[0].axes[0]
    low, high = axes.get_xlim()
    ticks = [tick for tick in axes.get_xticks() if low <= tick <= high]
    assert ticks and all(float(tick).is_integer() for tick in ticks), ticks


def test_readme_demos_command_writes_what_bc_lift_reads():
    readme = (REPO / "README.md").read_text()
    (out,) = re.findall(r"mmpo demos --task lift .*?--out (\S+)", readme)
    config = yaml.safe_load((REPO / "configs" / "robotics" / "bc_lift.yaml").read_text())
    assert out == config["data"]["init_args"]["dataset_path"]


def test_readme_and_quickstart_help_give_the_same_time():
    from mmpo.quickstart import build_parser

    readme = " ".join((REPO / "README.md").read_text().split())
    description = build_parser().description
    assert "About 3 minutes on 2 idle CPU cores" in readme and "About 3 minutes on 2 idle CPU cores" in description
    assert "15 minutes" not in description
