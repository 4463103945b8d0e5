"""Parity of mmpo's DPO-family losses (``mmpo.core.preference_loss``) with TRL 1.16.0's DPOTrainer code.

TRL computes the loss inline in ``DPOTrainer._compute_loss`` (which needs a model and an
accelerator). The script cuts the statements that turn sequence log-probs into the loss and the
reward metrics out of the wheel's source by their syntax tree and executes them as they are:

- the ``f_divergence_type`` statement (``reverse_kl``, standard DPO: scores = log-ratios),
- ``delta_score = chosen_scores - rejected_scores``,
- the ``if loss_type == ...`` chain inside ``for loss_type, loss_weight in zip(...)`` (one loss type,
  weight 1, ``use_weighting`` off), then ``per_sequence_loss.mean()`` as TRL's loop does,
- ``chosen_rewards`` / ``rejected_rewards`` / ``reward_accuracies`` / ``margins``.

Both sides get the same seeded float64 sequence log-probs (16 pairs, completions of 1-12 tokens for
IPO's length normalisation). Nothing of TRL is committed. Usage (prints a Markdown table):

    python bench/parity_trl_dpo.py [--trl-wheel trl-1.16.0-py3-none-any.whl]
"""

from __future__ import annotations

import argparse
import ast
from typing import Any

import torch
import torch.nn.functional as F

from parity_peer_losses import trl_source  # same folder: the team's wheel reader

from mmpo.core import preference_loss

DTYPE = torch.float64
_WANTED = ("chosen_logratios", "rejected_logratios", "delta_score", "chosen_rewards", "rejected_rewards",
           "reward_accuracies", "margins")


def trl_loss_statements(source: str) -> list[ast.stmt]:
    """The statements of ``DPOTrainer._compute_loss`` from the log-ratios to the reward metrics."""
    tree = ast.parse(source)
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DPOTrainer")
    method = next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "_compute_loss")
    picked: list[ast.stmt] = []
    for node in method.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in _WANTED for t in node.targets):
            picked.append(node)
        elif isinstance(node, ast.If) and "f_divergence_type" in ast.unparse(node.test):
            picked.append(node)
        elif isinstance(node, ast.For) and "loss_types" in ast.unparse(node.iter):
            chain = node.body[0]  # the if loss_type == ... chain; the weighting and the sum come after
            assert isinstance(chain, ast.If) and "loss_type" in ast.unparse(chain.test), ast.unparse(chain)[:200]
            picked.append(chain)
    return picked


class _Trainer:
    """The attributes of ``self`` the picked statements read."""

    def __init__(self, beta: float, label_smoothing: float) -> None:
        self.beta, self.label_smoothing = beta, label_smoothing
        self.f_divergence_type = "reverse_kl"


def run_trl(statements: list[ast.stmt], loss_type: str, logps: dict[str, torch.Tensor], completion_mask: torch.Tensor,
            beta: float, label_smoothing: float) -> dict[str, Any]:
    namespace: dict[str, Any] = {"self": _Trainer(beta, label_smoothing), "F": F, "torch": torch,
                                 "loss_type": loss_type, "completion_mask": completion_mask,
                                 "device": completion_mask.device, **logps}
    module = ast.Module(body=statements, type_ignores=[])
    exec(compile(ast.fix_missing_locations(module), "trl/trainer/dpo_trainer.py", "exec"), namespace)
    namespace["loss"] = namespace["per_sequence_loss"].mean()
    return namespace


def make_logps(seed: int, pairs: int = 16, spread: float = 1.0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 13, (2 * pairs,), generator=generator)
    mask = (torch.arange(12).expand(2 * pairs, 12) < lengths[:, None]).to(DTYPE)
    base = -lengths.to(DTYPE) * (0.5 + torch.rand(2 * pairs, generator=generator, dtype=DTYPE))
    ref = base + spread * torch.randn(2 * pairs, generator=generator, dtype=DTYPE)
    chosen, rejected = base.chunk(2)
    ref_chosen, ref_rejected = ref.chunk(2)
    logps = {"chosen_logps": chosen.clone().requires_grad_(True), "rejected_logps": rejected.clone().requires_grad_(True),
             "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    return logps, mask


CASES = (  # (TRL loss_type, mmpo name, beta, label_smoothing, mmpo settings)
    ("sigmoid", "sigmoid", 0.1, 0.0, {}),
    ("sigmoid", "sigmoid", 0.5, 0.0, {}),
    ("robust", "robust", 0.1, 0.1, {}),
    ("robust", "robust", 0.5, 0.3, {}),
    ("hinge", "hinge", 0.1, 0.0, {}),
    ("ipo", "ipo", 0.1, 0.0, {"length_normalize": True}),
    ("ipo", "ipo", 0.5, 0.0, {"length_normalize": True}),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-wheel", default=None, help="trl-1.16.0 wheel (default: pip download it)")
    args = parser.parse_args()
    statements = trl_loss_statements(trl_source(args.trl_wheel, "trl/trainer/dpo_trainer.py"))
    print("| TRL loss_type | beta | label_smoothing | batches | max abs diff loss | max abs diff grad | "
          "max abs diff rewards/* metrics |")
    print("|---|---|---|---|---|---|---|")
    for trl_name, ours_name, beta, eps, settings in CASES:
        worst = [0.0, 0.0, 0.0]
        seeds = (0, 1, 2)
        for seed in seeds:
            logps, mask = make_logps(seed, spread=(0.05, 0.3, 1.0)[seed])
            peer = run_trl(statements, trl_name, logps, mask, beta, eps)
            peer_grads = torch.autograd.grad(peer["loss"], [logps["chosen_logps"], logps["rejected_logps"]])
            chosen_mask, rejected_mask = mask.chunk(2)
            ours, metrics = preference_loss(ours_name, *logps.values(), beta=beta, label_smoothing=eps,
                                            chosen_lengths=chosen_mask.sum(1), rejected_lengths=rejected_mask.sum(1),
                                            **settings)
            our_grads = torch.autograd.grad(ours, [logps["chosen_logps"], logps["rejected_logps"]])
            peer_metrics = {"rewards/chosen": peer["chosen_rewards"].mean(), "rewards/rejected": peer["rejected_rewards"].mean(),
                            "rewards/margins": peer["margins"].mean(), "rewards/accuracies": peer["reward_accuracies"].mean()}
            worst[0] = max(worst[0], float((ours - peer["loss"]).detach().abs()))
            worst[1] = max(worst[1], max(float((a - b).abs().max()) for a, b in zip(our_grads, peer_grads)))
            worst[2] = max(worst[2], max(abs(metrics[k] - float(v)) for k, v in peer_metrics.items()))
        print(f"| `{trl_name}` | {beta} | {eps} | {len(seeds)} | {worst[0]:.1e} | {worst[1]:.1e} | {worst[2]:.1e} |")


if __name__ == "__main__":
    main()
