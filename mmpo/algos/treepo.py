"""TreePO: tree-structured segment rollouts with subtree baselines (arXiv 2508.17445).

Official code: ``multimodal-art-projection/TreePO`` (verl fork; sampler
``vLLMRollout.generate_sequences_tree_deepth_first_vanilla_mode``, estimator
``compute_tree_reinforce_plus_plus_baseline_outcome_advantage``, recipe ``recipe/treepo/run_treepo_train.sh``).

Rollout (:func:`grow_trees`, on the frontier loop of :mod:`mmpo.algos.tree_rollout`): every active path generates one segment of ``segment_len`` tokens; a path
that emits EOS (or reaches ``max_new_tokens``) becomes a leaf; the others fork. The first fork has
``first_branching`` children; afterwards each prompt's budget for the next step is
``min(w - finished, b * finished_this_step + b * active)`` (at least one per active path), split evenly
across its active paths, so paths that stop early hand their forks to their siblings and a prompt never
exceeds ``w = num_generations`` leaves. Leaves are trained as full sequences (a shared prefix counts
once per leaf, as the official trainer does). Advantage: ``treepo`` in :mod:`mmpo.core.advantages_tree`.

Not implemented from the official sampler: the DFS fallback that re-forks finished paths when a prompt
ends with fewer than ``w`` leaves, the boxed-answer / repetition early stops, and probability-based
divergence (an ablation). A prompt can therefore end with fewer than ``w`` leaves (never fewer than
``first_branching``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from mmpo.algos.config import refuse_rollout_correction, require
from mmpo.algos.grpo import GRPOModule
from mmpo.algos.tree_rollout import grow_frontier
from mmpo.training.config import AdvantageConfig, as_config
from mmpo.core import compute_advantages_with_metrics, dynamic_sampling_filter
from mmpo.core.advantages_tree import TREE_WEIGHTINGS
from mmpo.vlm.continuation import ended, extend_prompts, generate_from_inputs
from mmpo.vlm.processing import select_rows
from mmpo.vlm.rollout import HFGenerateEngine, Rollout


@dataclass
class _Path:
    root: int  # index of the first-segment sample the path grew from (its prompt)
    group: int  # prompt index
    ids: Tensor  # tokens so far (masked-in only)
    choices: list[int] = field(default_factory=list)
    done: bool = False


def fork_counts(active: int, finished: int, finished_now: int, *, width: int, branching: int) -> list[int]:
    """Children of each of a prompt's ``active`` paths at the next step (TreePO's ``fixed_avg`` budget).

    budget = min(width - finished, branching * finished_now + branching * active), at least ``active``;
    split evenly, the remainder going to the first paths. Example: width 4, branching 2, 2 active,
    none finished -> [2, 2]; then 4 active -> [1, 1, 1, 1].
    """
    if active == 0:
        return []
    budget = max(active, min(width - finished, branching * finished_now + branching * active))
    base, extra = divmod(budget, active)
    return [base + (1 if i < extra else 0) for i in range(active)]


@torch.no_grad()
def grow_trees(
    engine: HFGenerateEngine,
    rows: Sequence[Mapping[str, Any]],
    *,
    width: int,
    segment_len: int,
    max_new_tokens: int,
    branching: int = 2,
    first_branching: int = 2,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> Rollout:
    """Sample a segment tree per row; return its leaves as a rollout with ``extras["tree_path_ids"]``
    ``(N, D)`` (branch choice per depth, -1 below a leaf that stopped early; D = ceil(max_new_tokens /
    segment_len)) and ``extras["tree_depth"]`` ``(N,)`` (segments in the leaf)."""
    depth_max = math.ceil(max_new_tokens / segment_len)
    first = engine.generate(rows, num_samples=first_branching, max_new_tokens=min(segment_len, max_new_tokens),
                            temperature=temperature, top_p=top_p)
    first_ended = ended(first, engine.eos_token_id)
    paths = [
        _Path(root=i, group=int(first.group_ids[i]), ids=first.completion_ids[i][first.completion_mask[i] > 0],
              choices=[i % first_branching], done=bool(first_ended[i]) or max_new_tokens <= segment_len)
        for i in range(len(first))
    ]

    def expand(parents: list[tuple[_Path, int]]) -> list[_Path]:
        prefix = torch.nn.utils.rnn.pad_sequence([p.ids for p, _ in parents], batch_first=True,
                                                 padding_value=engine.pad_token_id)
        prefix_mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(p.ids) for p, _ in parents], batch_first=True)
        prompts = extend_prompts(select_rows(first.prompt_inputs, [p.root for p, _ in parents]), prefix, prefix_mask,
                                 pad_token_id=engine.pad_token_id)
        budget = min(segment_len, max_new_tokens - max(len(p.ids) for p, _ in parents))
        step = generate_from_inputs(engine, [first.rows[p.root] for p, _ in parents], prompts,
                                    max_new_tokens=max(budget, 1), temperature=temperature, top_p=top_p)
        step_ended = ended(step, engine.eos_token_id)
        grown = []
        for i, (parent, child) in enumerate(parents):
            ids = torch.cat([parent.ids, step.completion_ids[i][step.completion_mask[i] > 0]])
            grown.append(_Path(root=parent.root, group=parent.group, ids=ids, choices=parent.choices + [child],
                               done=bool(step_ended[i]) or len(ids) >= max_new_tokens))
        return grown

    paths = grow_frontier(paths, group_of=lambda p: p.group, expand=expand, max_depth=depth_max,
                          fork=lambda active, finished, finished_now: fork_counts(
                              len(active), finished, finished_now, width=width, branching=branching))
    paths.sort(key=lambda p: (p.group, p.choices))
    return _leaves_rollout(engine, first, paths, depth_max)


def _leaves_rollout(engine: HFGenerateEngine, first: Rollout, paths: list[_Path], depth_max: int) -> Rollout:
    width = max(1, max(len(p.ids) for p in paths))
    ids = torch.full((len(paths), width), engine.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(paths), width), dtype=torch.long)
    path_ids = torch.full((len(paths), depth_max), -1, dtype=torch.long)
    for i, p in enumerate(paths):
        ids[i, : len(p.ids)] = p.ids
        mask[i, : len(p.ids)] = 1
        path_ids[i, : len(p.choices)] = torch.tensor(p.choices)
    return Rollout(
        rows=[first.rows[p.root] for p in paths],
        group_ids=torch.tensor([p.group for p in paths], dtype=torch.long),
        prompt_inputs=select_rows(first.prompt_inputs, [p.root for p in paths]),
        completion_ids=ids,
        completion_mask=mask,
        texts=engine.processor.batch_decode(ids, skip_special_tokens=True),
        extras={"tree_path_ids": path_ids, "tree_depth": torch.tensor([len(p.choices) for p in paths])},
    )


class TreePOModule(GRPOModule):
    """GRPO with TreePO's tree rollouts and subtree-baseline advantages (arXiv 2508.17445).

    ``num_generations`` is the tree width w (most leaves per prompt; recipe 16) and ``max_new_tokens`` the
    response budget (recipe 7168 = depth 14 x 512). The recipe's clip 0.2 / 0.28, dual clip 10 and DAPO's
    root-group zero-std filter (``dynamic_sampling: true``) are set in ``configs/vlm/variants/treepo_tiny.yaml``.

    Args:
        model_path: saved HF model directory.
        segment_len: tokens per tree node (recipe 512).
        branching: children per fork (recipe 2).
        first_branching: children of the root (the recipe's fixed initial divergence 2).
        tree_weighting: ``average`` (recipe) or ``group_size`` over depths.
        skip_zero_std_subgroups: leave out subtrees whose rewards all agree (off in the recipe).
        **kwargs: every :class:`GRPOModule` setting (``advantage`` is fixed to ``treepo``).
    """

    def __init__(
        self,
        model_path: str,
        *,
        advantage: AdvantageConfig = AdvantageConfig(name="treepo"),
        segment_len: int = 512,
        branching: int = 2,
        first_branching: int = 2,
        tree_weighting: str = "average",
        skip_zero_std_subgroups: bool = False,
        **kwargs: Any,
    ) -> None:
        advantage = as_config(advantage, AdvantageConfig(name="treepo"))
        require(advantage.name == "treepo", "TreePOModule's advantage is 'treepo'")
        super().__init__(model_path, advantage=advantage, **kwargs)

    def _validate_settings(self) -> None:
        super()._validate_settings()
        h = self.hparams
        require(h.segment_len >= 1, f"segment_len must be >= 1, got {h.segment_len}")
        require(h.branching >= 1, f"branching must be >= 1, got {h.branching}")
        require(2 <= h.first_branching <= self.sampling.num_generations,
                f"first_branching must be in [2, num_generations={self.sampling.num_generations}] "
                "(the root group needs two "
                f"leaves), got {h.first_branching}")
        require(h.tree_weighting in TREE_WEIGHTINGS, f"tree_weighting must be one of {TREE_WEIGHTINGS}, got {h.tree_weighting!r}")
        require(self.optim.minibatch_size is None, "TreePO's leaf count varies per step: set minibatch_size null "
                                          "(one optimizer step per rollout)")
        require(not self.advantage.dynamic_sampling_retries,
                "dynamic_sampling_retries is not supported with tree rollouts")
        refuse_rollout_correction(self.rollout_correction)

    def build_rollout(self, rows: Sequence[Mapping[str, Any]]) -> Rollout:
        h = self.hparams
        return grow_trees(self.engine, rows, width=self.sampling.num_generations, segment_len=h.segment_len,
                          max_new_tokens=self.sampling.max_new_tokens, branching=h.branching,
                          first_branching=h.first_branching,
                          temperature=self.sampling.temperature, top_p=self.sampling.top_p)

    def compute_advantages(self, rewards: Tensor, group_ids: Tensor, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        h = self.hparams
        mask = rollout.completion_mask.to(rewards)
        if self.advantage.dynamic_sampling:
            # the recipe rejects zero-std prompts before the estimator: they stay out of the whitening too
            mask = mask * dynamic_sampling_filter(rewards, group_ids).keep_mask.to(rewards).unsqueeze(-1)
        if float(mask.sum()) < 2:  # nothing left to whiten: every prompt was filtered (the step is then skipped)
            return torch.zeros_like(mask), {"treepo/leaves_per_prompt": len(rollout) / float(torch.unique(group_ids).numel())}
        advantages, metrics = compute_advantages_with_metrics(
            "treepo", rewards, group_ids, mask=mask, path_ids=rollout.extras["tree_path_ids"],
            weighting=h.tree_weighting, skip_zero_std_subgroups=h.skip_zero_std_subgroups)
        metrics["treepo/leaves_per_prompt"] = len(rollout) / float(torch.unique(group_ids).numel())
        metrics["treepo/depth_mean"] = float(rollout.extras["tree_depth"].float().mean())
        return advantages, metrics
