"""Parity of mmpo's DPO-family losses (``mmpo.core.preference_loss``) with TRL 1.16.0's DPOTrainer code.

TRL computes the loss inline in ``DPOTrainer._compute_loss`` (which needs a model and an
accelerator). The script cuts the statements that turn sequence log-probs into the loss and the
reward metrics out of the wheel's source by their syntax tree and executes them as they are:

- the ``f_divergence_type`` statement (``reverse_kl``, standard DPO: scores = log-ratios),
- ``delta_score = chosen_scores - rejected_scores``,
- ``loss = 0.0`` and the whole ``for loss_type, loss_weight in zip(self.loss_types, self.loss_weights)``
  loop (its ``if loss_type == ...`` chain and ``loss += per_sequence_loss.mean() * loss_weight``;
  ``use_weighting`` off): one loss type at weight 1, or a DPO-family type plus ``sft`` at weight
  alpha, TRL 1.16.0's form of RPO (mmpo: ``rpo_alpha``; TRL's ``sft`` term is the chosen tokens'
  mean NLL ``batch_loss``, compared with mmpo's ``losses/sft``),
- ``chosen_rewards`` / ``rejected_rewards`` / ``reward_accuracies`` / ``margins``.

Both sides get the same seeded float64 per-token log-probs (16 pairs, completions of 1-12 tokens;
IPO's length normalisation and the ``sft`` term need the tokens): TRL reads them per token, mmpo their
per-sequence sums and token counts; the gradients are taken with respect to the per-token values.
Nothing of TRL is committed. Usage (prints a Markdown table):

    python bench/parity_trl_dpo.py [--trl-wheel trl-1.16.0-py3-none-any.whl]
"""

from __future__ import annotations

import argparse
import ast
from typing import Any

import torch
import torch.nn.functional as F

from mmpo.eval.peers import trl_source

from mmpo.core import preference_loss

DTYPE = torch.float64
_WANTED = ("loss", "chosen_logratios", "rejected_logratios", "delta_score", "chosen_rewards", "rejected_rewards",
           "reward_accuracies", "margins")


def trl_loss_statements(source: str) -> list[ast.stmt]:
    """The statements of ``DPOTrainer._compute_loss`` from the log-ratios to the loss and the reward metrics."""
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
            chain = node.body[0]  # the if loss_type == ... chain; the weighting and the weighted sum come after
            assert isinstance(chain, ast.If) and "loss_type" in ast.unparse(chain.test), ast.unparse(chain)[:200]
            assert "loss_weight" in ast.unparse(node.body[-1]), ast.unparse(node.body[-1])[:200]
            picked.append(node)
    inits = [ast.unparse(n) for n in picked if isinstance(n, ast.Assign) and "loss" in [getattr(t, "id", None) for t in n.targets]]
    assert inits == ["loss = 0.0"], inits  # the loop's accumulator, set once before it
    return picked


class _Trainer:
    """The attributes of ``self`` the picked statements read."""

    def __init__(self, beta: float, label_smoothing: float, loss_types: list[str], loss_weights: list[float]) -> None:
        self.beta, self.label_smoothing = beta, label_smoothing
        self.loss_types, self.loss_weights = loss_types, loss_weights
        self.f_divergence_type = "reverse_kl"
        self.use_weighting = False


def run_trl(statements: list[ast.stmt], loss_types: list[str], loss_weights: list[float],
            per_token_logps: torch.Tensor, logps: dict[str, torch.Tensor], completion_mask: torch.Tensor,
            beta: float, label_smoothing: float) -> dict[str, Any]:
    namespace: dict[str, Any] = {"self": _Trainer(beta, label_smoothing, loss_types, loss_weights), "F": F,
                                 "torch": torch, "completion_mask": completion_mask,
                                 # the completion tokens only: the shifted mask and the per-token log-probs align
                                 "shift_completion_mask": completion_mask, "per_token_logps": per_token_logps,
                                 "device": completion_mask.device, **logps}
    module = ast.Module(body=statements, type_ignores=[])
    exec(compile(ast.fix_missing_locations(module), "trl/trainer/dpo_trainer.py", "exec"), namespace)
    return namespace


def make_logps(seed: int, pairs: int = 16, spread: float = 1.0
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(per-token log-probs (2P, 12), a leaf; their masked sums and the reference's; the completion mask),
    rows ordered [chosen | rejected] as TRL's batch."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 13, (2 * pairs,), generator=generator)
    mask = (torch.arange(12).expand(2 * pairs, 12) < lengths[:, None]).to(DTYPE)
    per_token = (-(0.05 + 1.9 * torch.rand(2 * pairs, 12, generator=generator, dtype=DTYPE)) * mask).requires_grad_(True)
    sequence = (per_token * mask).sum(1)
    ref = sequence.detach() + spread * torch.randn(2 * pairs, generator=generator, dtype=DTYPE)
    chosen, rejected = sequence.chunk(2)
    ref_chosen, ref_rejected = ref.chunk(2)
    logps = {"chosen_logps": chosen, "rejected_logps": rejected, "ref_chosen_logps": ref_chosen,
             "ref_rejected_logps": ref_rejected}
    return per_token, logps, mask


CASES = (  # (TRL loss_type list, loss_weights, mmpo name, beta, label_smoothing, mmpo settings)
    (["sigmoid"], [1.0], "sigmoid", 0.1, 0.0, {}),
    (["sigmoid"], [1.0], "sigmoid", 0.5, 0.0, {}),
    (["robust"], [1.0], "robust", 0.1, 0.1, {}),
    (["robust"], [1.0], "robust", 0.5, 0.3, {}),
    (["hinge"], [1.0], "hinge", 0.1, 0.0, {}),
    (["ipo"], [1.0], "ipo", 0.1, 0.0, {"length_normalize": True}),
    (["ipo"], [1.0], "ipo", 0.5, 0.0, {"length_normalize": True}),
    # RPO: TRL 1.16.0 adds the chosen NLL as loss type "sft" with its weight; mmpo's rpo_alpha
    (["sigmoid", "sft"], [1.0, 1.0], "sigmoid", 0.1, 0.0, {"rpo_alpha": 1.0}),
    (["sigmoid", "sft"], [1.0, 0.5], "sigmoid", 0.5, 0.0, {"rpo_alpha": 0.5}),
    (["robust", "sft"], [1.0, 2.0], "robust", 0.1, 0.1, {"rpo_alpha": 2.0}),
    (["ipo", "sft"], [1.0, 1.0], "ipo", 0.1, 0.0, {"length_normalize": True, "rpo_alpha": 1.0}),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-wheel", default=None, help="trl-1.16.0 wheel (default: pip download it)")
    args = parser.parse_args()
    statements = trl_loss_statements(trl_source(args.trl_wheel, "trl/trainer/dpo_trainer.py"))
    print("| TRL loss_type | loss_weights | mmpo | beta | label_smoothing | batches | max abs diff loss | "
          "max abs diff grad | max abs diff rewards/* (and losses/sft) metrics |")
    print("|---|---|---|---|---|---|---|---|---|")
    for trl_types, weights, ours_name, beta, eps, settings in CASES:
        worst = [0.0, 0.0, 0.0]
        seeds = (0, 1, 2)
        for seed in seeds:
            per_token, logps, mask = make_logps(seed, spread=(0.05, 0.3, 1.0)[seed])
            peer = run_trl(statements, trl_types, weights, per_token, logps, mask, beta, eps)
            (peer_grad,) = torch.autograd.grad(peer["loss"], [per_token], retain_graph=True)
            chosen_mask, rejected_mask = mask.chunk(2)
            ours, metrics = preference_loss(ours_name, *logps.values(), beta=beta, label_smoothing=eps,
                                            chosen_lengths=chosen_mask.sum(1), rejected_lengths=rejected_mask.sum(1),
                                            **settings)
            (our_grad,) = torch.autograd.grad(ours, [per_token])
            peer_metrics = {"rewards/chosen": peer["chosen_rewards"].mean(), "rewards/rejected": peer["rejected_rewards"].mean(),
                            "rewards/margins": peer["margins"].mean(), "rewards/accuracies": peer["reward_accuracies"].mean()}
            if "sft" in trl_types:
                peer_metrics["losses/sft"] = peer["batch_loss"]
            worst[0] = max(worst[0], float((ours - peer["loss"]).detach().abs()))
            worst[1] = max(worst[1], float((our_grad - peer_grad).abs().max()))
            worst[2] = max(worst[2], max(abs(metrics[k] - float(v.detach())) for k, v in peer_metrics.items()))
        ours_label = ours_name + (f", rpo_alpha {settings['rpo_alpha']}" if "rpo_alpha" in settings else "")
        print(f"| {' + '.join(f'`{t}`' for t in trl_types)} | {weights} | {ours_label} | {beta} | {eps} | {len(seeds)} | "
              f"{worst[0]:.1e} | {worst[1]:.1e} | {worst[2]:.1e} |")


if __name__ == "__main__":
    main()
