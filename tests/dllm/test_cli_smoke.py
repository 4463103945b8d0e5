"""Tiny-budget end-to-end runs: SFT warm-up, then ``mmpo fit -c configs/dllm/igpo_tiny.yaml``."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from mmpo.dllm.eval import is_dllm_checkpoint
from mmpo.dllm.warmup import ensure_warm_model
from mmpo.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = [
    "--model.init_args.tiny.hidden_size=32",
    "--model.init_args.tiny.num_layers=1",
    "--model.init_args.tiny.num_heads=2",
    "--model.init_args.tiny.intermediate_size=64",
]
TINY_DATA = ["--data.init_args.train_size=64", "--data.init_args.test_size=8", "--data.init_args.val_size=4"]


def _metrics(root: Path) -> list[dict[str, str]]:
    files = sorted(root.rglob("metrics.csv"))
    assert files, f"no metrics.csv under {root}"
    with open(files[-1]) as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_sft_then_igpo_fit_end_to_end(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    warm = tmp_path / "sft" / "model"
    ensure_warm_model(
        warm, REPO / "configs/dllm/sft_tiny.yaml",
        ["--trainer.max_steps=3", "--data.init_args.batch_size=8", "--trainer.logger=false",
         f"--trainer.callbacks.init_args.dirpath={tmp_path / 'sft_ckpt'}", "--trainer.enable_progress_bar=false", *TINY_MODEL, *TINY_DATA],
    )
    assert is_dllm_checkpoint(str(warm))
    out = tmp_path / "igpo"

    def fit_igpo(max_steps: int, log_dir, *extra: str) -> None:
        main([
            "fit", "-c", str(REPO / "configs/dllm/igpo_tiny.yaml"),
            f"--model.init_args.model_path={warm}", "--model.init_args.warmup_config=null",
            f"--model.init_args.save_dir={out / 'model'}", f"--trainer.default_root_dir={out}",
            f"--trainer.callbacks.init_args.dirpath={out / 'ckpt'}",
            "--model.init_args.group_size=4", "--model.init_args.optim.mu=2",
            "--model.init_args.sampler.gen_length=32", "--model.init_args.sampler.steps=8",
            f"--trainer.max_steps={max_steps}", "--trainer.val_check_interval=2", "--trainer.enable_progress_bar=false",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.init_args.save_dir={log_dir}",
            "--data.init_args.batch_size=2", *TINY_DATA, *extra,
        ])

    fit_igpo(4, out)
    assert is_dllm_checkpoint(str(out / "model"))
    rows = _metrics(out)
    sampled = [float(r["igpo/frac_all_wrong_sampled"]) for r in rows if r.get("igpo/frac_all_wrong_sampled")]
    final = [float(r["igpo/frac_all_wrong"]) for r in rows if r.get("igpo/frac_all_wrong")]
    assert len(sampled) == 2  # 4 optimizer steps = 2 batches x 2 inner updates
    assert all(f <= s for f, s in zip(final, sampled))  # replacement can only remove all-wrong groups
    assert any(r.get("val/accuracy") for r in rows)
    assert any(r.get("losses/policy") for r in rows)

    # the config's ModelCheckpoint wrote last.ckpt; `--ckpt_path .../last.ckpt` continues the run from it
    assert (out / "ckpt" / "last.ckpt").is_file()
    fit_igpo(6, out / "resumed", f"--ckpt_path={out / 'ckpt' / 'last.ckpt'}")
    first_steps = [int(r["step"]) for r in rows if r.get("igpo/frac_all_wrong_sampled")]
    resumed = [int(r["step"]) for r in _metrics(out / "resumed") if r.get("igpo/frac_all_wrong_sampled")]
    # 4 of 6 optimizer steps were done: one more batch (2 inner updates), logged after the first run's
    assert len(resumed) == 1 and resumed[0] > max(first_steps), f"resume went wrong: {first_steps} then {resumed}"


def test_missing_model_without_warmup_config_is_a_clear_error(tmp_path):
    from mmpo.dllm.rl import DiffuGRPO

    with pytest.raises(FileNotFoundError, match="no model at"):
        DiffuGRPO(model_path=str(tmp_path / "nothing"), warmup_config=None)
