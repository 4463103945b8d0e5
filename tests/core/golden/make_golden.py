"""Regenerate core_golden.json: inputs, advantages, losses and gradients on a fixed tiny batch.

The test ``tests/core/test_golden.py`` recomputes everything from the stored inputs and
compares, so a refactor cannot silently change the math. A plain run only ADDS entries for
names the artifact lacks (a newly registered estimator or loss), keeping every stored value;
rewrite everything (inputs included) only for an intended change of a formula, and say so in
the commit message:

    python tests/core/golden/make_golden.py          # add missing entries
    python tests/core/golden/make_golden.py --all    # regenerate everything
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import torch

from mmpo.core import ADVANTAGE_ESTIMATORS, AGGREGATION_MODES, POLICY_LOSSES, compute_advantages, policy_loss

HERE = Path(__file__).parent


def make_inputs() -> dict:
    gen = torch.Generator().manual_seed(1234)
    batch, time = 6, 5
    old = torch.log_softmax(torch.randn(batch, time, 9, generator=gen, dtype=torch.float64), -1)[..., 0]
    log_probs = old + 0.35 * torch.randn(batch, time, generator=gen, dtype=torch.float64)
    mask = torch.zeros(batch, time, dtype=torch.float64)
    for i, length in enumerate([5, 2, 4, 1, 3, 5]):
        mask[i, :length] = 1
    return {
        "rewards": [1.0, 0.0, 0.5, 1.0, 1.0, 0.0],
        "group_ids": [4, 4, 4, 9, 9, 9],
        "log_probs": log_probs.tolist(),
        "old_log_probs": old.tolist(),
        "mask": mask.tolist(),
    }


def _advantage_inputs(
    name: str, rewards: torch.Tensor, groups: torch.Tensor, mask: torch.Tensor, old: torch.Tensor
) -> dict:
    """Per-estimator inputs derived from the stored batch (so old artifacts need no new inputs)."""
    params = inspect.signature(ADVANTAGE_ESTIMATORS.get(name)).parameters
    settings: dict = {}
    if name == "mapo_random_lambda":
        settings["generator"] = torch.Generator().manual_seed(0)
    if "mask" in params:
        settings["mask"] = mask
    if "reward_baselines" in params:
        # stand-in greedy reward: the reward of the first sample of each group
        first = {}
        for i, g in enumerate(groups.tolist()):
            first.setdefault(g, float(rewards[i]))
        settings["reward_baselines"] = torch.tensor([first[g] for g in groups.tolist()], dtype=rewards.dtype)
    if "static_values" in params:
        # stand-in static value (PVPO): a fixed value per group, unrelated to the group's own rewards
        settings["static_values"] = torch.where(groups == groups[0], 0.25, 0.75).to(rewards.dtype)
    if "budgets" in params:
        # stand-in HBPO budgets: two subgroups per group (budgets 2 and 4 tokens of an L_max of 5)
        settings["budgets"] = torch.tensor([2, 4] * (rewards.numel() // 2) + [2] * (rewards.numel() % 2))
        settings["max_length"] = 5
    if "sum_pi_squared" in params:
        # the sampled token's pi_t and a stand-in sum_v pi_v^2 >= pi_t^2
        settings["old_log_probs"] = old
        settings["sum_pi_squared"] = old.exp() ** 2 + 0.05
    settings.update(structured_inputs(name, rewards, groups, mask, old))
    return settings


def structured_inputs(
    name: str, rewards: torch.Tensor, groups: torch.Tensor, mask: torch.Tensor, old: torch.Tensor
) -> dict:
    """Stand-in rollout structure for the issue-16 estimators (brpo, treepo, segment, tppo); also used by
    tests/core/test_cross_product.py."""
    n, width = mask.shape
    if name == "brpo":
        # two budgets whose uniform-prior mean is the reward; tokens 0-2 in budget 1, 3-4 in budget 2
        return {"budget_scores": torch.stack([rewards - 0.25, rewards + 0.25], 1),
                "segment_ids": (torch.arange(width) // 3).clamp_max(1).expand(n, width).clone()}
    if name == "treepo":
        # the k-th leaf of its prompt takes branches [k // 2, k % 2]: leaves 0 and 1 share the first segment
        rank = torch.tensor([groups[:i].eq(g).sum().item() for i, g in enumerate(groups)])
        return {"path_ids": torch.stack([rank // 2, rank % 2], 1)}
    if name == "segment":
        from mmpo.core.advantages_tree import segment_cut_points

        values = torch.full((n, width + 1), float("nan"), dtype=rewards.dtype)
        for i, cuts in enumerate(segment_cut_points(old, mask, interval=1)):
            for c in cuts:
                values[i, c + 1] = 0.5 + 0.1 * c
        return {"old_log_probs": old, "state_values": values}
    if name == "tppo":
        return {"values": 0.5 * mask, "completed": torch.arange(n) % 2 == 0,
                "bootstrap_values": torch.full((n,), 0.3, dtype=rewards.dtype)}
    return {}


def compute(inputs: dict) -> dict:
    rewards = torch.tensor(inputs["rewards"], dtype=torch.float64)
    groups = torch.tensor(inputs["group_ids"])
    old = torch.tensor(inputs["old_log_probs"], dtype=torch.float64)
    mask = torch.tensor(inputs["mask"], dtype=torch.float64)
    out: dict = {"advantages": {}, "losses": {}}
    for name in ADVANTAGE_ESTIMATORS.names():
        settings = _advantage_inputs(name, rewards, groups, mask, old)
        out["advantages"][name] = compute_advantages(name, rewards, groups, **settings).tolist()
    adv = torch.tensor(out["advantages"]["grpo"], dtype=torch.float64)
    for loss_name in POLICY_LOSSES.names():
        for agg in AGGREGATION_MODES:
            lp = torch.tensor(inputs["log_probs"], dtype=torch.float64, requires_grad=True)
            # clip_cov draws the tokens it drops: a seeded generator keeps the entry reproducible
            settings = {"generator": torch.Generator().manual_seed(0)} if loss_name == "clip_cov" else {}
            if "entropy" in inspect.signature(POLICY_LOSSES.get(loss_name)).parameters:
                settings["entropy"] = -old  # stand-in per-token entropy (HAPO): -log pi_old of the sampled token
            loss, _ = policy_loss(loss_name, lp, old, adv, mask, agg=agg, **settings)
            (grad,) = torch.autograd.grad(loss, lp)
            out["losses"][f"{loss_name}/{agg}"] = {"loss": loss.item(), "grad": grad.tolist()}
    return out


def add_missing(payload: dict) -> list[str]:
    """Add the entries ``payload`` lacks, computed from its stored inputs; stored entries are kept."""
    fresh = compute(payload["inputs"])
    added = []
    for section, entries in fresh.items():
        stored = payload["outputs"].setdefault(section, {})
        for key, value in entries.items():
            if key not in stored:
                stored[key] = value
                added.append(f"{section}/{key}")
    return added


if __name__ == "__main__":
    path = HERE / "core_golden.json"
    if "--all" in sys.argv[1:] or not path.exists():
        inputs = make_inputs()
        payload = {"inputs": inputs, "outputs": compute(inputs)}
    else:
        payload = json.loads(path.read_text())
        print("added:", add_missing(payload) or "nothing")
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(path)  # atomic: a failed run leaves the committed artifact intact
    print(f"wrote {path}")
