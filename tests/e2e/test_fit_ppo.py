"""configs/vlm/ppo_tiny.yaml and configs/llm/ppo_tiny.yaml train 2 steps through `mmpo fit` (PPO with a value model),
the critic is trained and exported; a critic warm-up leaves the policy untouched."""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from mmpo.algos.ppo import VALUE_HEAD_FILE, TokenValueModel
from mmpo.cli import main
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus
from mmpo.vlm.factory import build_tiny_vlm, load_vlm
from tiny_vlm_support import tiny_grpo_fit_args

REPO = Path(__file__).resolve().parents[2]


def _text_args(tmp_path: Path, base: Path, out: Path, *overrides: str) -> list[str]:
    """2 steps of configs/llm/ppo_tiny.yaml on the tiny text LM: G = 2, 4 new tokens, 2 prompts a batch."""
    return ["fit", "-c", str(REPO / "configs" / "llm" / "ppo_tiny.yaml"),
            f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}", "--trainer.max_steps=2",
            "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
            f"--model.init_args.model_path={base}", f"--model.init_args.output_dir={out}",
            "--model.init_args.sampling.num_generations=2", "--model.init_args.sampling.max_new_tokens=4",
            *overrides, "--data.init_args.tasks=[long_arithmetic,word_problem]", "--data.init_args.train_size=4",
            "--data.init_args.batch_size=2"]


def _rows(log_dir: Path) -> list[dict[str, str]]:
    (path,) = log_dir.glob("**/metrics.csv")
    return list(csv.DictReader(path.open()))


def _differs(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return any(not torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_vlm_ppo_config_trains_policy_and_critic(tmp_path):
    texts = [SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)]
    tiny = build_tiny_vlm(tmp_path / "tiny", corpus=texts, vocab_size=400, hidden_size=64, intermediate_size=128)
    run = tmp_path / "ppo"
    assert main(tiny_grpo_fit_args(REPO / "configs" / "vlm" / "ppo_tiny.yaml", str(tiny), run,
                                   "--trainer.callbacks.init_args.every_n_train_steps=2",
                                   "--model.init_args.kl_coef=0.01")) == 0
    out = run / "hf"
    base, _ = load_vlm(tiny)
    policy, _ = load_vlm(out)
    assert _differs(policy, base)
    assert (out / "critic" / VALUE_HEAD_FILE).is_file()
    critic = TokenValueModel.load(out / "critic")
    assert _differs(critic.backbone, base)  # the critic's backbone trained too
    rows = _rows(run)
    logged = {k for r in rows for k, v in r.items() if v}
    for key in ("losses/policy", "losses/value", "value/clipfrac", "value/error_mean", "critic/values_mean",
                "critic/returns_mean", "critic/explained_variance", "ppo/kl_in_reward", "policy/clipfrac",
                "rewards/total/mean"):
        assert key in logged, key
    ckpt = torch.load(run / "ckpt" / "last.ckpt", weights_only=True, map_location="cpu")
    assert ckpt["global_step"] == 2
    assert any(k.startswith("value_model.head.") for k in ckpt["state_dict"])
    groups = ckpt["optimizer_states"][0]["param_groups"]
    assert len(groups) == 2 and groups[1]["lr"] == 1.0e-4 and groups[1]["weight_decay"] == 0.01


def test_llm_ppo_config_with_critic_warmup(tmp_path):
    base = tmp_path / "text_base"
    assert main(["build-tiny", "--kind", "text", "--out", str(base), "--vocab-size", "400", "--hidden-size", "32",
                 "--intermediate-size", "64", "--num-layers", "1"]) == 0
    out = tmp_path / "text_ppo"
    # both steps are critic warm-up: the policy must come out exactly as it went in, the critic must not
    assert main(_text_args(tmp_path / "ppo", base, out, "--model.init_args.critic.warmup_steps=2")) == 0
    model, _ = load_vlm(base)
    policy, _ = load_vlm(out)
    assert type(policy).__name__ == "Qwen3ForCausalLM"
    assert not _differs(policy, model)
    critic = TokenValueModel.load(out / "critic")
    assert _differs(critic.backbone, model)
    rows = _rows(tmp_path / "ppo")
    assert [float(r["critic/warmup"]) for r in rows if r.get("critic/warmup")] == [1.0, 1.0]
