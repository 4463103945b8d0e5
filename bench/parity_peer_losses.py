"""Parity of mmpo's verl / TRL losses and KL names with the peers' own code, on the same seeded tensors.

verl: ``verl/trainer/ppo/core_algos.py`` at commit b178a3cd, read from a git mirror with
``git show`` into a temporary file and imported with stubs for its verl-internal imports
(``masked_sum`` / ``masked_mean`` are taken from the same commit's ``torch_functional.py`` by
their source; the config classes are plain attribute holders). Its own ``compute_policy_loss_*``
and ``kl_penalty`` functions are then called.

TRL 1.16.0: the wheel is fetched with ``pip download trl==1.16.0 --no-deps``. ``GRPOTrainer``'s
VESPO weight (``get_gamma_weights``, a static method) is taken from the wheel by its source and
called; the SAPO / LUSPO / VESPO loss lines live inline in ``GRPOTrainer._compute_loss`` (which
needs a model and an accelerator), so they are transcribed below from that file, line numbers cited.

Nothing of either peer is committed. Usage (prints a Markdown table: max |diff| of the loss and of
its gradient, and the max relative difference):

    python bench/parity_peer_losses.py --verl-git /path/to/verl.git [--trl-wheel trl-1.16.0-py3-none-any.whl]
"""

from __future__ import annotations

import argparse
import types
from typing import Any, Callable

import torch

from mmpo.core import AGGREGATION_MODES, kl_penalty, policy_loss
from mmpo.eval.peers import (
    VERL_COMMIT,
    Batch,
    function_source,
    load_verl,
    make_batch,
    trl_grpo_trainer_source,
)


def load_trl_gamma_weights(wheel: str | None) -> Callable[..., torch.Tensor]:
    """``GRPOTrainer.get_gamma_weights`` from the TRL 1.16.0 wheel, by its source."""
    import math

    source = trl_grpo_trainer_source(wheel)
    namespace: dict[str, Any] = {"torch": torch, "math": math}
    exec(function_source(source, "get_gamma_weights", "GRPOTrainer"), namespace)
    return torch.no_grad()(namespace["get_gamma_weights"])


def _loss_and_grad(fn: Callable[[torch.Tensor], torch.Tensor], log_probs: torch.Tensor, seed: int = 0):
    lp = log_probs.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)  # clip_cov draws its tokens from torch's global generator, in both
    loss = fn(lp)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad


def _diff(ours: tuple[torch.Tensor, torch.Tensor], peer: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float, float]:
    loss_abs = (ours[0] - peer[0]).abs().item()
    grad_abs = (ours[1] - peer[1]).abs().max().item()
    scale = max(peer[0].abs().item(), peer[1].abs().max().item(), 1e-30)
    return loss_abs, grad_abs, max(loss_abs, grad_abs) / scale


def _actor(verl: types.ModuleType, **policy_loss_cfg: Any) -> Any:
    C = verl.Config
    return C(tau_pos=policy_loss_cfg.pop("tau_pos", 1.0), tau_neg=policy_loss_cfg.pop("tau_neg", 1.05),
             clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, global_batch_info={},
             policy_loss=C(**{"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0,
                              "kl_cov_ratio": 2e-4, "ppo_kl_coef": 0.1, **policy_loss_cfg}))


def verl_rows(verl: types.ModuleType, b: Batch) -> list[tuple[str, str, tuple[float, float, float]]]:
    rows = []
    adv_bt = b.adv.unsqueeze(-1).expand_as(b.log_probs)

    def run(peer_name: str, agg: str, cfg: Any, ours_name: str, ours_agg: str, **settings: Any) -> None:
        fn = verl.get_policy_loss_fn(peer_name)
        peer = _loss_and_grad(lambda lp: fn(b.old, lp, adv_bt, b.mask, loss_agg_mode=agg, config=cfg)[0], b.log_probs)
        # verl's seq-mean-token-sum-norm is sum / L, without Dr.GRPO's division by the number of
        # sequences (mmpo: sum / (seqs * norm_len)): reproduce it with norm_len = L / seqs
        norm_len = b.mask.shape[-1] / len(b.lengths) if ours_agg == "seq-mean-token-sum-norm" else None
        ours = _loss_and_grad(
            lambda lp: policy_loss(ours_name, lp, b.old, b.adv, b.mask, agg=ours_agg, norm_len=norm_len,
                                   **settings)[0], b.log_probs
        )
        note = f" (ours: {ours_agg})" if ours_agg != agg else (" (ours: norm_len L/seqs)" if norm_len else "")
        rows.append((f"verl `{peer_name}`", agg + note + (f" {settings}" if settings else ""), _diff(ours, peer)))

    # SAPO: verl forces seq-mean-token-mean whatever loss_agg_mode says (its quirk): compare that mode
    for taus in ((1.0, 1.05), (0.5, 2.0)):
        cfg = _actor(verl, tau_pos=taus[0], tau_neg=taus[1])
        for agg in AGGREGATION_MODES:
            run("sapo", agg, cfg, "sapo", "seq-mean-token-mean", tau_pos=taus[0], tau_neg=taus[1])
    for agg in AGGREGATION_MODES:
        run("gpg", agg, _actor(verl), "gpg", agg)
    for agg in AGGREGATION_MODES:
        run("clip_cov", agg, _actor(verl), "clip_cov", agg)
        # a wide covariance band and ratio: many tokens dropped, drawn from the same global RNG state
        run("clip_cov", agg, _actor(verl, clip_cov_ratio=0.3, clip_cov_lb=0.01, clip_cov_ub=5.0), "clip_cov", agg,
            clip_cov_ratio=0.3, clip_cov_lb=0.01, clip_cov_ub=5.0)
        run("kl_cov", agg, _actor(verl), "kl_cov", agg)
        run("kl_cov", agg, _actor(verl, kl_cov_ratio=0.25, ppo_kl_coef=1.0), "kl_cov", agg,
            kl_cov_ratio=0.25, ppo_kl_coef=1.0)
    for name in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"):
        peer = _loss_and_grad(lambda lp: (verl.kl_penalty(lp, b.ref, name) * b.mask).sum(), b.log_probs)
        ours = _loss_and_grad(lambda lp: (kl_penalty(lp, b.ref, name) * b.mask).sum(), b.log_probs)
        rows.append((f"verl KL `{name}`", "masked sum", _diff(ours, peer)))
    return rows


def trl_rows(gamma_weights: Callable[..., torch.Tensor], b: Batch) -> list[tuple[str, str, tuple[float, float, float]]]:
    rows = []
    adv = b.adv.unsqueeze(1)  # TRL's (B, 1)
    mask = b.mask

    def sapo(lp: torch.Tensor, tau_pos: float = 1.0, tau_neg: float = 1.05) -> torch.Tensor:
        # grpo_trainer.py 1.16.0, lines 3121-3124 (token-level coef_1) and 3153-3154 (aggregation)
        coef_1 = torch.exp(lp - b.old)
        temperatures = torch.where(adv > 0, tau_pos, tau_neg)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * adv
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()

    def luspo(lp: torch.Tensor, eps_low: float = 2e-3, eps_high: float = 2.5e-3) -> torch.Tensor:
        # lines 3077-3080 (importance_sampling_level="sequence"), 3112-3119, 3175-3180
        log_ratio = lp - b.old
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        coef_1 = torch.exp(log_w)
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
        return (per_token_loss * mask).sum(-1).mean()

    def vespo(lp: torch.Tensor) -> torch.Tensor:
        # lines 3125-3136 (get_gamma_weights is TRL's own, from the wheel) and 3168-3173 (one process,
        # num_items_in_batch = the batch's tokens: a token mean)
        phi_seq = gamma_weights(adv, lp - b.old, mask, None)
        per_token_loss = -phi_seq * adv * lp
        return (per_token_loss * mask).sum() / mask.sum()

    def compare(label: str, peer_fn: Callable, ours_name: str, agg: str, **settings: Any) -> None:
        peer = _loss_and_grad(peer_fn, b.log_probs)
        ours = _loss_and_grad(lambda lp: policy_loss(ours_name, lp, b.old, b.adv, mask, agg=agg, **settings)[0],
                              b.log_probs)
        rows.append((label, agg + (f" {settings}" if settings else ""), _diff(ours, peer)))

    compare("TRL `sapo`", sapo, "sapo", "seq-mean-token-mean")
    compare("TRL `sapo`", lambda lp: sapo(lp, 0.5, 2.0), "sapo", "seq-mean-token-mean", tau_pos=0.5, tau_neg=2.0)
    compare("TRL `luspo`", luspo, "luspo", "seq-mean-token-mean")
    compare("TRL `luspo`", lambda lp: luspo(lp, 0.2, 0.28), "luspo", "seq-mean-token-mean", clip_low=0.2, clip_high=0.28)
    compare("TRL `vespo`", vespo, "vespo", "token-mean")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verl-git", required=True, help="git dir of a verl clone holding commit b178a3cd")
    parser.add_argument("--trl-wheel", default=None, help="trl-1.16.0 wheel (default: pip download it)")
    args = parser.parse_args()
    verl = load_verl(args.verl_git)
    gamma_weights = load_trl_gamma_weights(args.trl_wheel)
    rows = []
    for seed, spread in ((0, 0.3), (1, 0.05), (2, 1.0)):
        b = make_batch(seed, spread)
        tag = f"seed {seed}, |l - l_old| ~ {spread}"
        rows += [(peer, f"{setting}; {tag}", diff) for peer, setting, diff in verl_rows(verl, b) + trl_rows(gamma_weights, b)]
    summary: dict[str, list[tuple[float, float, float]]] = {}
    for peer, _, diff in rows:
        summary.setdefault(peer, []).append(diff)
    print("| peer function | comparisons | max abs diff loss | max abs diff grad | max rel diff |")
    print("|---|---|---|---|---|")
    for peer, diffs in summary.items():
        worst = [max(d[i] for d in diffs) for i in range(3)]
        print(f"| {peer} | {len(diffs)} | {worst[0]:.1e} | {worst[1]:.1e} | {worst[2]:.1e} |")
    print("\nEvery comparison:\n")
    print("| peer function | setting; inputs | max abs diff loss | max abs diff grad | max rel diff |")
    print("|---|---|---|---|---|")
    for peer, setting, (loss_abs, grad_abs, rel) in rows:
        print(f"| {peer} | {setting} | {loss_abs:.1e} | {grad_abs:.1e} | {rel:.1e} |")
    print(f"\n{len(rows)} comparisons, worst relative difference {max(d[2] for _, _, d in rows):.1e}")
    # verl's straight-through names cannot be compared: at b178a3cd its kl_penalty raises for them
    b = make_batch()
    for name in ("k1+", "k3+", "low_var_kl+"):
        try:
            verl.kl_penalty(b.log_probs, b.ref, name)
            print(f"verl KL `{name}`: returned a value (mmpo's hand-tested straight-through form may differ)")
        except NotImplementedError:
            print(f"verl KL `{name}`: raises NotImplementedError at {VERL_COMMIT} (mmpo: hand-tested, docs/core.md KL)")


if __name__ == "__main__":
    main()
