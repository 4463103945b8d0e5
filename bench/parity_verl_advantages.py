"""Parity of mmpo's verl advantage estimators with verl's own ``core_algos.py`` on seeded inputs.

verl is not a dependency (it pulls Ray, vLLM, ...). This script reads verl's real source from a
git checkout or mirror (``--verl-git-dir``, else ``$MMPO_VERL_GIT_DIR``; required), imports
``verl/trainer/ppo/core_algos.py`` with small stand-ins for its verl-internal imports (config
classes, a ``deprecated`` decorator) and verl's own ``masked_mean/var/whiten`` extracted from
``verl/utils/torch_functional.py``, runs both implementations on the same tensors and prints the
max absolute / relative difference per name. No verl code is stored in this repository.

    python bench/parity_verl_advantages.py --verl-git-dir PATH/TO/verl/.git [--commit b178a3cd]
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
import tempfile
import types
from pathlib import Path

import torch

from mmpo.core import compute_advantages
from mmpo.eval.peers import VERL_COMMIT, VERL_GIT_DIR_ENV, git_show, verl_git_dir

def _functions_from(source: str, names: set[str]) -> dict:
    """Exec only the named top-level functions of ``source`` (verl's real code, no module imports)."""
    tree = ast.parse(source)
    keep = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    namespace: dict = {"torch": torch}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "verl_torch_functional", "exec"), namespace)
    return {name: namespace[name] for name in names}


class _Config(dict):
    """Stand-in for verl's AlgoConfig: attribute and ``.get`` access."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def load_verl_core_algos(git_dir: str, commit: str) -> types.ModuleType:
    functional = _functions_from(git_show(git_dir, commit, "verl/utils/torch_functional.py"),
                                 {"masked_sum", "masked_mean", "masked_var", "masked_whiten"})
    stubs = {
        "omegaconf": {"DictConfig": dict},
        "verl": {}, "verl.trainer": {}, "verl.workers": {},
        "verl.utils": {"as_torch_index": None, "group_mean_std": None},
        "verl.utils.torch_functional": functional,
        "verl.trainer.config": {"AlgoConfig": _Config},
        "verl.utils.import_utils": {"deprecated": lambda *a, **k: (lambda fn: fn)},
        "verl.workers.config": {"ActorConfig": type("ActorConfig", (), {})},
    }
    saved = {name: sys.modules.get(name) for name in stubs}
    for name, attrs in stubs.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "verl_core_algos.py"
            path.write_text(git_show(git_dir, commit, "verl/trainer/ppo/core_algos.py"))
            spec = importlib.util.spec_from_file_location("verl_core_algos", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
    finally:  # leave no stand-in behind for other imports
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return module


def make_batch(seed: int, dtype: torch.dtype, *, groups: int = 16, size: int = 4, width: int = 32,
               binary: bool = True, sizes: list[int] | None = None) -> dict:
    """Seeded inputs; ``sizes`` (one per group) gives groups of different sizes instead of ``groups`` x ``size``."""
    gen = torch.Generator().manual_seed(seed)
    sizes = sizes if sizes is not None else [size] * groups
    n = sum(sizes)
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(dtype)
    if binary:
        rewards = torch.randint(0, 2, (n,), generator=gen).to(dtype)
    else:
        rewards = torch.rand(n, generator=gen, dtype=torch.float64).to(dtype) * 2 - 0.5
    group_ids = torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes))
    perm = torch.randperm(n, generator=gen)  # groups interleaved, not contiguous
    rewards, group_ids, mask, lengths = rewards[perm], group_ids[perm], mask[perm], lengths[perm]
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(n), lengths - 1] = rewards  # the outcome score on the last token
    dense = torch.rand(n, width, generator=gen, dtype=torch.float64).to(dtype) * mask
    baselines = torch.randint(0, 2, (n,), generator=gen).to(dtype)
    # OTB inputs: log pi of the sampled token and sum_v pi_v^2 of a random 50-way softmax per position
    probs = torch.softmax(3 * torch.randn(n, width, 50, generator=gen, dtype=torch.float64), -1)
    old_log_probs = probs[..., 0].log().to(dtype)
    sum_pi_squared = (probs**2).sum(-1).to(dtype)
    is_weights = torch.rand(n, width, generator=gen, dtype=torch.float64).to(dtype) + 0.5
    # a multi-turn mask: a hole (tool output) inside the completion of every third sample
    holed = mask.clone()
    holed[::3, 2:5] = 0
    holed[5] = 0  # and one empty completion
    return dict(rewards=rewards, group_ids=group_ids, mask=mask, token_rewards=token_rewards, dense=dense,
                baselines=baselines, index=group_ids.numpy().astype(object), old_log_probs=old_log_probs,
                sum_pi_squared=sum_pi_squared, is_weights=is_weights, holed=holed)


def cases(verl: types.ModuleType, b: dict):
    """(name, mmpo advantages (N, T), verl advantages (N, T)) for every estimator and setting."""
    r, g, m, tr, idx = b["rewards"], b["group_ids"], b["mask"], b["token_rewards"], b["index"]

    def seq(adv):  # mmpo's per-sequence advantages broadcast like verl's
        return adv.unsqueeze(-1) * m if adv.ndim == 1 else adv

    for gamma in (1.0, 0.9):
        yield (f"reinforce_plus_plus (gamma={gamma})",
               compute_advantages("reinforce_plus_plus", r, g, mask=m, gamma=gamma),
               verl.compute_reinforce_plus_plus_outcome_advantage(tr.clone(), m, config=_Config(gamma=gamma))[0])
    dense_sum = (b["dense"] * m).sum(-1)
    yield ("reinforce_plus_plus (token rewards, gamma=0.95)",
           compute_advantages("reinforce_plus_plus", dense_sum, g, mask=m, gamma=0.95, token_rewards=b["dense"]),
           verl.compute_reinforce_plus_plus_outcome_advantage(b["dense"].clone(), m, config=_Config(gamma=0.95))[0])
    yield ("reinforce_plus_plus_baseline",
           compute_advantages("reinforce_plus_plus_baseline", r, g, mask=m),
           verl.compute_reinforce_plus_plus_baseline_outcome_advantage(tr.clone(), m, idx, config=_Config())[0])
    yield ("opo", seq(compute_advantages("opo", r, g, mask=m)),
           verl.compute_opo_outcome_advantage(tr.clone(), m, idx, config=_Config())[0])
    for norm in (True, False):
        yield (f"grpo_passk (norm_adv_by_std={norm})",
               seq(compute_advantages("grpo_passk", r, g, norm_adv_by_std=norm)),
               verl.compute_grpo_passk_outcome_advantage(
                   tr.clone(), m, idx, config=_Config(norm_adv_by_std_in_grpo=norm))[0])
    yield ("gpg", seq(compute_advantages("gpg", r, g)),
           verl.compute_gpg_outcome_advantage(tr.clone(), m, idx)[0])
    otb = dict(old_log_probs=b["old_log_probs"], sum_pi_squared=b["sum_pi_squared"])
    for zero_tail, weights in ((False, None), (True, None), (False, b["is_weights"])):
        setting = f"zero_tail={zero_tail}, IS={'yes' if weights is not None else 'no'}"
        yield (f"optimal_token_baseline ({setting})",
               compute_advantages("optimal_token_baseline", r, g, mask=m, handle_zero_tail=zero_tail,
                                  rollout_is_weights=weights, **otb),
               verl.compute_optimal_token_baseline_advantage(
                   tr.clone(), m, idx, rollout_is_weights=weights, handle_zero_tail=zero_tail, **otb)[0])
    holed = b["holed"]
    holed_rewards = (b["dense"] * holed).sum(-1)
    for zero_tail in (True, False):
        yield (f"tir_optimal_token_baseline (holed masks, dense rewards, zero_tail={zero_tail})",
               compute_advantages("tir_optimal_token_baseline", holed_rewards, g, mask=holed,
                                  token_rewards=b["dense"], handle_zero_tail=zero_tail, **otb),
               verl.compute_multi_turn_optimal_token_baseline_advantage(
                   b["dense"].clone(), holed, idx, handle_zero_tail=zero_tail, **otb)[0])
    yield ("remax", seq(compute_advantages("remax", r, g, reward_baselines=b["baselines"])),
           verl.compute_remax_outcome_advantage(tr.clone(), b["baselines"], m, config=_Config())[0])


def one_sample_cases(verl: types.ModuleType, b: dict):
    """The estimators that accept a group of one (REINFORCE++, its baseline variant, ReMax), on a batch
    of singletons and mixed group sizes."""
    r, g, m, tr, idx = b["rewards"], b["group_ids"], b["mask"], b["token_rewards"], b["index"]
    for gamma in (1.0, 0.9):
        yield (f"reinforce_plus_plus (gamma={gamma}, groups of 1-4)",
               compute_advantages("reinforce_plus_plus", r, g, mask=m, gamma=gamma),
               verl.compute_reinforce_plus_plus_outcome_advantage(tr.clone(), m, config=_Config(gamma=gamma))[0])
    yield ("reinforce_plus_plus_baseline (groups of 1-4)",
           compute_advantages("reinforce_plus_plus_baseline", r, g, mask=m),
           verl.compute_reinforce_plus_plus_baseline_outcome_advantage(tr.clone(), m, idx, config=_Config())[0])
    yield ("remax (groups of 1-4)", compute_advantages("remax", r, g, reward_baselines=b["baselines"]).unsqueeze(-1) * m,
           verl.compute_remax_outcome_advantage(tr.clone(), b["baselines"], m, config=_Config())[0])


#: group sizes of the one-sample batches: 10 singletons among groups of 2-4
MIXED_SIZES = [1, 3, 1, 1, 2, 4, 1, 1, 2, 1, 3, 1, 1, 4, 1, 2]


def differences(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float]:
    """Max abs difference, and max relative difference over entries where |verl| > 1e-6."""
    ours, theirs = ours.double(), theirs.double()
    diff = (ours - theirs).abs()
    big = theirs.abs() > 1e-6
    rel = float((diff[big] / theirs.abs()[big]).max()) if bool(big.any()) else 0.0
    return float(diff.max()), rel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verl-git-dir", default=None,
                        help=f"git dir of a verl clone or mirror holding --commit (default: ${VERL_GIT_DIR_ENV})")
    parser.add_argument("--commit", default=VERL_COMMIT)
    args = parser.parse_args(argv)
    verl = load_verl_core_algos(verl_git_dir(args.verl_git_dir), args.commit)
    rows: dict[tuple[str, str], tuple[float, float]] = {}
    for dtype in (torch.float64, torch.float32):
        for seed, binary in ((0, True), (1, False), (2, True), (3, False)):
            batch = make_batch(seed, dtype, binary=binary)
            mixed = make_batch(seed, dtype, binary=binary, sizes=MIXED_SIZES)
            for name, ours, theirs in [*cases(verl, batch), *one_sample_cases(verl, mixed)]:
                if ours.shape != theirs.shape:
                    raise SystemExit(f"{name}: shape {tuple(ours.shape)} vs verl {tuple(theirs.shape)}")
                key = (name, str(dtype).replace("torch.", ""))
                old = rows.get(key, (0.0, 0.0))
                new = differences(ours, theirs)
                rows[key] = (max(old[0], new[0]), max(old[1], new[1]))
    print(f"verl core_algos.py @ {args.commit}; 4 seeded batches (binary and continuous rewards) of "
          "16 groups x 4, width 32, random lengths, interleaved groups; the 'groups of 1-4' rows: 16 groups "
          f"of sizes {MIXED_SIZES}\n")
    print("| estimator (setting) | dtype | max abs diff | max rel diff |")
    print("|---|---|---|---|")
    for (name, dtype), (abs_d, rel_d) in rows.items():
        print(f"| {name} | {dtype} | {abs_d:.2e} | {rel_d:.2e} |")
    worst = max(abs_d for abs_d, _ in rows.values())
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
