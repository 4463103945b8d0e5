"""Smoke runs of `mmpo fit -c configs/vlm/{sft,grpo}_tiny.yaml` with a tiny budget."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import yaml

from mmpo.cli import main
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus
from mmpo.vlm.factory import build_tiny_vlm, load_vlm

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "vlm"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    texts = [SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)]
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=texts, vocab_size=400, hidden_size=64,
                          intermediate_size=128)


def _common(tmp_path: Path, name: str) -> list[str]:
    return [
        f"--trainer.default_root_dir={tmp_path / name}",
        f"--trainer.logger.init_args.save_dir={tmp_path / name}",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / name / 'ckpt'}",
        "--trainer.callbacks.init_args.every_n_train_steps=2",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--data.init_args.tasks=[count_shapes,arithmetic]",
        "--data.init_args.train_size=8",
        "--data.init_args.val_size=2",
        "--data.init_args.batch_size=2",
    ]


def _metrics(log_dir: Path) -> list[dict[str, str]]:
    (path,) = log_dir.glob("**/metrics.csv")
    return list(csv.DictReader(path.open()))


def test_sft_then_grpo_through_the_cli(tiny_path, tmp_path):
    sft_out = tmp_path / "sft_hf"
    assert main([
        "fit", "-c", str(CONFIGS / "sft_tiny.yaml"), *_common(tmp_path, "sft"),
        f"--model.init_args.model_path={tiny_path}", f"--model.init_args.output_dir={sft_out}",
        "--model.init_args.val_max_new_tokens=4",
    ]) == 0
    model, _ = load_vlm(sft_out)  # HF weights of the SFT stage
    base, _ = load_vlm(tiny_path)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), base.parameters()))
    rows = _metrics(tmp_path / "sft")
    assert any(r.get("losses/sft") for r in rows) and any(r.get("val/accuracy") for r in rows)
    assert (tmp_path / "sft" / "ckpt" / "last.ckpt").is_file()

    grpo_out = tmp_path / "grpo_hf"
    assert main([
        "fit", "-c", str(CONFIGS / "grpo_tiny.yaml"), *_common(tmp_path, "grpo"),
        f"--model.init_args.model_path={sft_out}", f"--model.init_args.output_dir={grpo_out}",
        "--model.init_args.sampling.num_generations=2", "--model.init_args.sampling.max_new_tokens=4",
        "--model.init_args.loss.beta=0.01",
    ]) == 0
    load_vlm(grpo_out)
    rows = _metrics(tmp_path / "grpo")
    logged = {k for r in rows for k, v in r.items() if v}
    for key in ("losses/policy", "losses/kl", "losses/entropy", "policy/approx_kl", "policy/clipfrac",
                "policy/clipfrac_low", "policy/clipfrac_high", "rewards/accuracy/mean", "rewards/format/mean",
                "rewards/total/mean", "rewards/frac_zero_std", "response/length_mean", "perf/tokens_per_s",
                "kl", "entropy", "val/accuracy"):
        assert key in logged, key


def test_cli_reports_bad_settings(tiny_path, tmp_path, capsys):
    # a constructor's validation error is one final line naming the class (mmpo.training.cli_errors), exit 2
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(CONFIGS / "grpo_tiny.yaml"), *_common(tmp_path, "bad"),
              f"--model.init_args.model_path={tiny_path}", "--model.init_args.sampling.num_generations=1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "mmpo fit: error: model (mmpo.algos.grpo.GRPOModule): num_generations must be >= 2")


@pytest.mark.parametrize(("name", "class_path", "num_generations"), [
    ("sft_tiny", "mmpo.algos.sft.SFTModule", None),
    ("grpo_tiny", "mmpo.algos.grpo.GRPOModule", 8),
    ("grpo_qwen2_5_vl_3b", "mmpo.algos.grpo.GRPOModule", 5),
    ("grpo_qwen2_5_vl_7b", "mmpo.algos.grpo.GRPOModule", 5),
    # issue 16 variants (their 2-step fits run in tests/algos/test_variant_<name>.py)
    ("variants/brpo_tiny", "mmpo.algos.brpo.BRPOModule", 4),
    ("variants/tppo_tiny", "mmpo.algos.tppo.TPPOModule", 4),
    ("variants/segment_tiny", "mmpo.algos.segment.SegmentPOModule", 4),
    ("variants/treepo_tiny", "mmpo.algos.treepo.TreePOModule", 8),
])
def test_every_vlm_config_parses(name, class_path, num_generations, capsys):
    """The real-scale configs are not run here, but every key must be a valid init arg, and the
    printed (parsed) config must keep the module class and G that the YAML file states."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(CONFIGS / f"{name}.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert model["class_path"] == class_path
    if num_generations is None:  # SFT has no rollout group
        assert "sampling" not in model["init_args"]
    else:
        assert model["init_args"]["sampling"]["num_generations"] == num_generations


REAL_SIZE_CONFIGS = sorted(p.stem for p in CONFIGS.glob("*_qwen2_5_vl_*.yaml"))


@pytest.mark.parametrize("name", [*REAL_SIZE_CONFIGS, "grpo_tiny_fsdp", "dpo_tiny_fsdp"])
def test_sharded_configs_parse_with_fsdp2(name, capsys):
    """Every real-size config (and the tiny FSDP2 one) parses and shards with the tested FSDP2Strategy
    (tests/e2e/test_fsdp_vlm.py), not Lightning's FSDP1 ``fsdp``, which the VLM modules refuse."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(CONFIGS / f"{name}.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert trainer["strategy"]["class_path"] == "mmpo.training.fsdp.FSDP2Strategy"
