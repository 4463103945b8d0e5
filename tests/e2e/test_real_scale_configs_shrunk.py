"""Every real-scale VLM and text-LM config trains 2 steps through `mmpo fit` with only its scale shrunk.

The real-scale configs (Qwen2.5-VL-7B, Qwen3-8B, ...) name checkpoints and datasets this machine does not have
and GPUs it does not have. Everything else in them (the algorithm, its loss / advantage / reward settings, the
optimizer, gradient checkpointing, the reference dtype) runs here unchanged: the overrides below swap only the
model for a tiny one of the same family, the data for synthetic rows, the hardware for one CPU process, the
budget (G = 2, 4 new tokens, 2 prompts a batch, 2 steps) and the output paths. A setting that cannot run
(a typo, a class that moved, a combination the module refuses) fails here instead of on the user's cluster.

The real-scale dLLM config (configs/dllm/igpo_llada_8b.yaml) is shrunk the same way in
tests/dllm/test_real_scale_config_shrunk.py.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import yaml

from tiny_vlm_support import TEXT_TEST_TASKS, build_small_text_lm

from mmpo.cli import main
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus
from mmpo.vlm.factory import build_tiny_vlm

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _real_scale(family: str) -> list[str]:
    """Configs of ``family`` for real checkpoints: every one but the tiny ones (``*_tiny*.yaml``) and the TAROT
    testbed's (tiny models built by its bench; tests/e2e/test_fit_tarot_testbed.py trains them)."""
    return [f"{family}/{path.name}" for path in sorted((CONFIGS / family).glob("*.yaml"))
            if "_tiny" not in path.stem and not path.stem.startswith("tarot_testbed")]


VLM = _real_scale("vlm")
LLM = _real_scale("llm")


def test_the_real_scale_configs_are_found():
    assert len(VLM) >= 11 and "vlm/grpo_qwen2_5_vl_7b.yaml" in VLM and "vlm/inpo_qwen2_5_vl_7b.yaml" in VLM
    assert set(LLM) >= {"llm/grpo_qwen2_5_7b_instruct.yaml", "llm/grpo_qwen3_8b.yaml"}


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> str:
    texts = [SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)]
    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"), corpus=texts, vocab_size=400, hidden_size=64,
                              intermediate_size=128))


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory) -> str:
    return build_small_text_lm(tmp_path_factory.mktemp("tiny_text"))


def shrunk_fit_args(config: Path, model_path: str, tasks: list[str], out: Path) -> list[str]:
    """``mmpo fit`` arguments that keep ``config``'s algorithm and swap its scale (see the module docstring)."""
    module = yaml.safe_load(config.read_text())["model"]["class_path"].rsplit(".", 1)[1]
    if module == "DPOModule":  # offline pairs: no sampling group, no minibatches
        budget = ["--model.init_args.max_completion_length=8"]
    else:
        budget = ["--model.init_args.sampling.num_generations=2", "--model.init_args.sampling.max_new_tokens=4"]
        if module != "INPOModule":  # INPO's update is one pair batch (automatic optimisation)
            budget += ["--model.init_args.optim.minibatch_size=4", "--model.init_args.optim.micro_batch_size=2"]
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(out)}}
    checkpoints = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(out / "ckpt"), "save_last": True}}]
    return [
        "fit", "-c", str(config),
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1", "--trainer.strategy=auto",
        "--trainer.precision=32-true", f"--trainer.default_root_dir={out}", f"--trainer.logger={json.dumps(logger)}",
        f"--trainer.callbacks={json.dumps(checkpoints)}", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        f"--model.init_args.model_path={model_path}", f"--model.init_args.output_dir={out / 'hf'}", *budget,
        f"--data.init_args.tasks=[{','.join(tasks)}]", "--data.init_args.data_path=null",
        "--data.init_args.val_data_path=null", "--data.init_args.train_size=4", "--data.init_args.val_size=2",
        "--data.init_args.batch_size=2", "--data.init_args.num_workers=0",
    ]


def _two_finite_steps(out: Path) -> None:
    """The run ended after 2 optimizer steps (its last checkpoint says so) and every logged loss is finite
    (a step whose groups were all filtered out, e.g. PAPO-D's zero-variance masking, logs no loss)."""
    import torch

    checkpoint = torch.load(out / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 2
    (path,) = out.glob("**/metrics.csv")
    rows = list(csv.DictReader(path.open()))
    losses = [float(row[key]) for row in rows for key in row if key.startswith("losses/") and row[key]]
    assert all(math.isfinite(loss) for loss in losses)


@pytest.mark.parametrize("name", VLM)
def test_real_scale_vlm_config_trains_two_shrunk_steps(name, tiny_vlm, tmp_path):
    config = CONFIGS / name
    assert main(shrunk_fit_args(config, tiny_vlm, ["count_shapes", "arithmetic"], tmp_path)) == 0
    _two_finite_steps(tmp_path)
    (hparams,) = tmp_path.glob("**/hparams.yaml")
    saved, declared = yaml.safe_load(hparams.read_text()), yaml.safe_load(config.read_text())["model"]["init_args"]
    for group in ("loss", "optim", "advantage"):  # the config's own algorithm settings reached the module
        for key, value in (declared.get(group) or {}).items():
            if key not in ("minibatch_size", "micro_batch_size"):
                assert saved[group][key] == value, (group, key)


@pytest.mark.parametrize("name", LLM)
def test_real_scale_text_config_trains_two_shrunk_steps(name, tiny_text, tmp_path):
    assert main(shrunk_fit_args(CONFIGS / name, tiny_text, TEXT_TEST_TASKS, tmp_path)) == 0
    _two_finite_steps(tmp_path)
