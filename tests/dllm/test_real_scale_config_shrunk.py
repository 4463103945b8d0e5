"""configs/dllm/igpo_llada_8b.yaml trains 2 steps through `mmpo fit` with only its scale shrunk: a tiny
warm-started mask predictor instead of LLaDA-8B (plain weights, so no remote code; LoRA on its own projection names), the official settings'
canvas scaled from 256 to 32 tokens (and the hint spans with it), one CPU process in float32, and rows in the
config's own layout (TraceFileDataModule JSONL: problem, trace, answer) written here from the arithmetic task.
The algorithm settings (IGPO on, GSPO-style sequence loss, correctness 3.0 + xmlcount 1.0, LoRA, optim) are the
config's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import yaml

from mmpo.cli import main
from mmpo.dllm.task import ArithmeticTaskConfig, make_train_and_test
from mmpo.dllm.warmup import ensure_warm_model

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "dllm" / "igpo_llada_8b.yaml"
TINY_MODEL = ["--model.init_args.tiny.hidden_size=32", "--model.init_args.tiny.num_layers=1",
              "--model.init_args.tiny.num_heads=2", "--model.init_args.tiny.intermediate_size=64"]


def test_igpo_llada_8b_config_trains_two_shrunk_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    warm = tmp_path / "sft" / "model"
    ensure_warm_model(warm, REPO / "configs/dllm/sft_tiny.yaml",
                      ["--trainer.max_steps=2", "--data.init_args.batch_size=8", "--trainer.logger=false",
                       f"--trainer.callbacks.init_args.dirpath={tmp_path / 'sft_ckpt'}",
                       "--trainer.enable_progress_bar=false", *TINY_MODEL, "--data.init_args.train_size=64",
                       "--data.init_args.test_size=8", "--data.init_args.val_size=4"])
    train, test = make_train_and_test(ArithmeticTaskConfig(), 8, 4, 0)
    for name, rows in (("train.jsonl", train), ("test.jsonl", test)):
        (tmp_path / name).write_text("".join(json.dumps({k: row[k] for k in ("problem", "trace", "answer")}) + "\n"
                                             for row in rows))
    out = tmp_path / "igpo"
    assert main([
        "fit", "-c", str(CONFIG),
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy=auto", "--trainer.precision=32-true",
        "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={out}", f"--trainer.callbacks.init_args.dirpath={out / 'ckpt'}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.init_args.save_dir={out}",
        f"--model.init_args.model_path={warm}", "--model.init_args.trust_remote_code=false",
        "--model.init_args.dtype=float32", f"--model.init_args.save_dir={out / 'model'}",
        "--model.init_args.group_size=4", "--model.init_args.optim.mu=2",
        "--model.init_args.sampler.gen_length=32", "--model.init_args.sampler.block_length=8",
        "--model.init_args.sampler.steps=16",
        # the hint spans scaled with the canvas (256 -> 32): chunks 5..10 -> 1..2, free tail 30 -> 4
        "--model.init_args.hints.min_chunk=1", "--model.init_args.hints.max_chunk=2",
        "--model.init_args.hints.free_tail=4",
        # LoRA as configured (r 128, alpha 64, dropout 0.05) on the tiny model's projections (LLaDA's names differ)
        "--model.init_args.lora.target_modules=[Wqkv,Wo,Wi]",
        f"--data.init_args.train_path={tmp_path / 'train.jsonl'}", f"--data.init_args.test_path={tmp_path / 'test.jsonl'}",
        "--data.init_args.batch_size=2", "--data.init_args.val_batch_size=2", "--data.init_args.val_size=2",
    ]) == 0
    checkpoint = torch.load(out / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 2  # 1 batch x optim.mu 2 inner updates
    saved = checkpoint["hyper_parameters"]
    declared = yaml.safe_load(CONFIG.read_text())["model"]["init_args"]
    assert saved["loss"]["name"] == declared["loss"]["name"] == "igpo_sequence"
    assert saved["rewards"]["weights"] == {"correct": 3.0, "xmlcount": 1.0} and saved["igpo"]["enabled"]
    (metrics,) = out.glob("**/metrics.csv")
    losses = [float(v) for line in metrics.read_text().splitlines()[1:] for v in line.split(",") if v]
    assert losses and all(math.isfinite(v) for v in losses)
