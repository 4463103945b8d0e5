"""Parity of mmpo's rollout IS correction with verl's and TRL's own code, on the same seeded tensors.

verl b178a3cd: ``verl/trainer/ppo/rollout_corr_helper.py`` is read from a git mirror and imported
with stubs for its verl-internal imports (the loader and stubs of ``bench/parity_peer_losses.py``;
``DataProto`` and the config classes are plain holders); its ``compute_rollout_correction_weights``
(truncated IS, token / sequence), ``compute_offpolicy_metrics`` (``kl``, ``k3_kl``) and
``core_algos.compute_policy_loss_bypass_mode`` (bypass ``reinforce`` and ``ppo_clip``) are called.

TRL 1.16.0: the IS block of ``GRPOTrainer._generate_and_score_completions`` (the
``if self.use_vllm and self.vllm_importance_sampling_correction:`` statement that turns
``old_per_token_logps`` and ``sampling_per_token_logps`` into ``vllm_importance_sampling_ratio``)
is cut out of the wheel's source by its syntax tree and executed as is.

Usage (prints Markdown tables of max |diff|):

    python bench/parity_rollout_correction.py --verl-git /path/to/verl.git [--trl-wheel trl-1.16.0-py3-none-any.whl]
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import math
import sys
import tempfile
import types
from pathlib import Path
from typing import Callable

import torch

from mmpo.eval.peers import VERL_COMMIT, git_show, load_verl, make_batch, trl_grpo_trainer_source

from mmpo.core import policy_loss, rollout_is_weights

CAPS = (1.2, 2.0, 3.0)


class Config(dict):
    """verl's config objects: attribute and ``.get`` access."""

    __getattr__ = dict.__getitem__


def load_verl_rollout_corr(git_dir: str) -> tuple[types.ModuleType, types.ModuleType]:
    """(rollout_corr_helper, core_algos) at b178a3cd; the helper is registered under its verl name so
    that core_algos' bypass-mode loss imports it."""
    core_algos = load_verl(git_dir)  # installs the verl.* stubs (torch_functional by source)

    class DataProto:
        def __init__(self, tensors: dict) -> None:
            self.batch = tensors

        @classmethod
        def from_dict(cls, tensors: dict) -> "DataProto":
            return cls(tensors)

    for name, attrs in {
        "verl.protocol": {"DataProto": DataProto},
        "verl.trainer.config.algorithm": {"RolloutCorrectionConfig": Config},
        "verl.workers.config.actor": {"PolicyLossConfig": Config},
        "verl.trainer.ppo": {},
    }.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
    tmp = Path(tempfile.mkdtemp()) / "rollout_corr_helper.py"
    tmp.write_text(git_show(git_dir, VERL_COMMIT, "verl/trainer/ppo/rollout_corr_helper.py"))
    spec = importlib.util.spec_from_file_location("verl.trainer.ppo.rollout_corr_helper", tmp)
    helper = importlib.util.module_from_spec(spec)
    sys.modules["verl.trainer.ppo.rollout_corr_helper"] = helper
    spec.loader.exec_module(helper)
    return helper, core_algos


def load_trl_is_block(wheel: str | None) -> Callable[..., torch.Tensor]:
    """TRL 1.16.0's IS-ratio statement, executed on given tensors and settings."""
    tree = ast.parse(trl_grpo_trainer_source(wheel))
    block = next(
        node for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and ast.unparse(node.test) == "self.use_vllm and self.vllm_importance_sampling_correction"
        and "per_token_logps_diff" in ast.unparse(node)
    )
    code = compile(ast.Module(body=[block], type_ignores=[]), "trl_grpo_trainer_is_block", "exec")

    def run(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str, cap: float,
            cap_low: float | None) -> torch.Tensor:
        trainer = types.SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                                        vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=cap,
                                        vllm_importance_sampling_clip_min=cap_low)
        scope = {"self": trainer, "torch": torch, "math": math, "old_per_token_logps": old,
                 "sampling_per_token_logps": sampling, "completion_mask": mask, "tool_mask": None}
        exec(code, scope)
        return scope["vllm_importance_sampling_ratio"]

    return run


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def rows_for(helper, core_algos, trl_is, seed: int, spread: float) -> list[tuple[str, str, float]]:
    b = make_batch(seed, spread)  # old = the trainer's log-probs; log_probs = the engine's (rollout)
    trainer, engine, mask, current = b.old, b.log_probs, b.mask, b.old + 0.1 * (b.log_probs - b.old).flip(0)
    tag = f"seed {seed}, spread {spread}"
    rows = []
    for cap in CAPS:
        for level in ("token", "sequence"):
            peer, _ = helper.compute_rollout_correction_weights(trainer - engine, mask, rollout_is=level,
                                                                rollout_is_threshold=cap)
            ours, _ = rollout_is_weights(trainer, engine, mask, f"{level}_truncate", cap=cap)
            rows.append((f"verl `compute_rollout_correction_weights` {level}", f"C={cap}; {tag}", _max_abs(ours, peer)))
        for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
            for cap_low in (None, 0.5):
                peer = trl_is(trainer, engine, mask, mode, cap, cap_low).expand_as(mask) * mask
                ours, _ = rollout_is_weights(trainer, engine, mask, mode, cap=cap, cap_low=cap_low)
                rows.append((f"TRL `{mode}`", f"C={cap}, C_min={cap_low}; {tag}", _max_abs(ours, peer)))
    peer_metrics = helper.compute_offpolicy_metrics(trainer, engine, mask)
    _, ours_metrics = rollout_is_weights(trainer, engine, mask, "token_truncate", cap=2.0)
    for name in ("kl", "k3_kl"):
        rows.append((f"verl metric `{name}`", tag, abs(float(ours_metrics[f"rollout_is/{name}"]) - peer_metrics[name])))

    # bypass mode: old = engine; reinforce weights pi_current / pi_engine; ppo_clip has none
    adv_bt = b.adv.unsqueeze(-1).expand_as(mask)
    for loss_type, cap in (("reinforce", 2.0), ("reinforce", 1.2), ("ppo_clip", 2.0)):
        config = Config(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, global_batch_info={},
                        policy_loss=Config(rollout_correction=Config(loss_type=loss_type, rollout_is="token",
                                                                     rollout_is_threshold=cap)))

        def peer_fn(lp: torch.Tensor) -> torch.Tensor:
            return core_algos.compute_policy_loss_bypass_mode(engine, lp, adv_bt, mask, loss_agg_mode="token-mean",
                                                              config=config)[0]

        def ours_fn(lp: torch.Tensor) -> torch.Tensor:
            if loss_type == "ppo_clip":
                # verl's vanilla PPO always applies the dual clip (clip_ratio_c default 3.0)
                return policy_loss("ppo", lp, engine, b.adv, mask, dual_clip=3.0)[0]
            weights, _ = rollout_is_weights(lp.detach(), engine, mask, "token_truncate", cap=cap)
            return policy_loss("gpg", lp, engine, b.adv, mask, token_weights=weights)[0]

        diffs = []
        for fn in (peer_fn, ours_fn):
            lp = current.clone().requires_grad_(True)
            loss = fn(lp)
            diffs.append((loss.detach(), torch.autograd.grad(loss, lp)[0]))
        worst = max(abs(float(diffs[0][0] - diffs[1][0])), _max_abs(diffs[0][1], diffs[1][1]))
        ours_name = "ppo, dual_clip 3" if loss_type == "ppo_clip" else "gpg + token_truncate"
        rows.append((f"verl bypass `{loss_type}` (loss, grad)", f"C={cap}, ours: {ours_name}; {tag}", worst))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verl-git", required=True, help="git dir of a verl clone holding commit b178a3cd")
    parser.add_argument("--trl-wheel", default=None, help="trl-1.16.0 wheel (default: pip download it)")
    args = parser.parse_args()
    helper, core_algos = load_verl_rollout_corr(args.verl_git)
    trl_is = load_trl_is_block(args.trl_wheel)
    rows = []
    for seed, spread in ((0, 0.3), (1, 0.05), (2, 1.0)):
        rows += rows_for(helper, core_algos, trl_is, seed, spread)
    summary: dict[str, list[float]] = {}
    for peer, _, diff in rows:
        summary.setdefault(peer, []).append(diff)
    print("| peer function | comparisons | max abs diff |")
    print("|---|---|---|")
    for peer, diffs in summary.items():
        print(f"| {peer} | {len(diffs)} | {max(diffs):.1e} |")
    print(f"\n{len(rows)} comparisons (float64), worst {max(d for _, _, d in rows):.1e}")


if __name__ == "__main__":
    main()
