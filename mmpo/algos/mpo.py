"""MPO (Meta Policy Optimization; Kim et al. 2025, arXiv 2504.20157): a judge scores completions under a
rubric, and a meta judge rewrites the rubric during training.

Official code: minnesotanlp/mpo. ``trl/trainer/mpo_trainer.py`` calls
``meta_reward_model.meta_evaluate_and_update`` when ``update > 0 and update % num_mpo_interval == 0``
(``update`` counts batches from 1; ``num_mpo_interval`` 10, ``num_mpo_samples`` 20 in
``trl/trainer/mpo_config.py``), on the rollouts gathered since the last update, then reloads the reward
model with the newest rubric. ``trl/extras/mpo/__init__.py`` ``MetaRewardModel.meta_evaluate_and_update``:

1. draw ``num_samples`` of the gathered (prompt, completion, judge score) at random;
2. for each, the meta judge reads the current rubric, the sample and its score, analyses how the score
   went wrong, and writes a refined set of criteria (``mrm_analyze_and_refine``, ``rm_*.py``);
3. the meta judge merges all refined sets into one (``mrm_merge``); the ``<item>...</item>`` criteria of its
   reply, deduplicated, form rubric_{k+1} = ``"<rubric>\\n" + "\\n\\n".join(items) + "</rubric>"``, saved as
   ``evaluation_rubric_iter_{k+1}.txt``.

The reward model (``rm_essay_writing.py`` ``RewardModelEssayWriting.score``) scores each rubric item with an
integer and sums them. Here the judge is a ``rewards.models`` entry (mmpo.rewards.models) whose ``rubric``
template names ``{rubric}``: the current rubric is passed in every row's ``rubric`` column; a judge that
writes one ``<score>n</score>`` per item with ``score_reduce: sum`` gives the official sum (one reply for
all items instead of one request per item). Analysis and refinement are one meta-judge request per sample
(the official runs them as one two-turn SGLang program). Deduplication keeps the first occurrence of each
item in order (the official's ``set`` has no order). A meta reply without items leaves the rubric as it
was (counted in ``mpo/failed_updates``).

State (:class:`RubricState`: rubric, iteration, batches seen, the samples gathered since the last update)
is checkpointed with :class:`~mmpo.training.state_hooks.CheckpointedState`: a resumed run judges with the
rubric it had reached. With ``mpo_rubric_dir`` every rubric is also written (atomically) as
``evaluation_rubric_iter_<k>.txt``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmpo.algos.grpo import GRPOModule
from mmpo.algos.config import require
from mmpo.training.state_hooks import CheckpointedState
from mmpo.training.step_state import StepState
from mmpo.vlm.rollout import Rollout

ITEM = re.compile(r"<item>(.*?)</item>", re.MULTILINE | re.DOTALL)
"""A rubric criterion (the official merge step's regex, ``trl/extras/mpo/__init__.py``)."""

DEFAULT_ANALYZE_PROMPT = (
    "You supervise a junior grader who scores responses with the rubric below.\n"
    "{rubric}\n\n"
    "Question:\n<question>{prompt}</question>\n"
    "Response:\n<response>{completion}</response>\n"
    "The junior grader's score: <score>{score}</score>\n\n"
    "Analyse whether the score reflects the response's real quality; look for ways the response games the "
    "rubric. Then write the complete refined set of scoring criteria, each enclosed in an XML element named item."
)
"""Analyse-and-refine request (the role of ``mrm_analyze.txt`` + ``mrm_refine.txt`` of the official prompts;
wording our own). Fields: ``{rubric}``, ``{prompt}``, ``{completion}``, ``{score}`` and any row column."""

DEFAULT_MERGE_PROMPT = (
    "Below are several sets of scoring criteria written for the same task.\n"
    "{sets}\n\n"
    "Merge them into one set of non-overlapping, distinct criteria that covers all of them, each "
    "enclosed in an XML element named item."
)
"""Merge request (the role of ``mrm_merge.txt``; wording our own). Field: ``{sets}``."""


def rubric_items(text: str) -> list[str]:
    """The stripped, non-empty ``<item>`` criteria of ``text`` in order."""
    return [item.strip() for item in ITEM.findall(text) if item.strip()]


def format_rubric(items: Sequence[str]) -> str:
    """The official rubric text: ``"<rubric>\\n" + "\\n\\n".join("<item>\\n{i}\\n</item>") + "</rubric>"``."""
    return "<rubric>\n" + "\n\n".join(f"<item>\n{item}\n</item>" for item in items) + "</rubric>"


def merge_items(sets: Sequence[Sequence[str]]) -> list[str]:
    """Every distinct item of ``sets``, first occurrence first."""
    seen: dict[str, None] = {}
    for items in sets:
        for item in items:
            seen.setdefault(item.strip(), None)
    return [item for item in seen if item]


def is_update_batch(batch: int, interval: int) -> bool:
    """The official trigger: ``update > 0 and update % num_mpo_interval == 0`` (``batch`` counts from 1)."""
    return batch > 0 and batch % interval == 0


class RubricState:
    """MPO's state between steps, checkpointed: the rubric, its iteration k, the batches seen, and the
    samples (prompt, completion, judge score, row columns) gathered since the last rubric update."""

    def __init__(self, rubric: str) -> None:
        self.rubric = rubric
        self.iteration = 0
        self.batches = 0
        self.failed_updates = 0
        self.samples: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"rubric": self.rubric, "iteration": self.iteration, "batches": self.batches,
                "failed_updates": self.failed_updates, "samples": [dict(s) for s in self.samples]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rubric = str(state["rubric"])
        self.iteration = int(state["iteration"])
        self.batches = int(state["batches"])
        self.failed_updates = int(state.get("failed_updates", 0))
        self.samples = [dict(s) for s in state.get("samples", [])]


def _plain_columns(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's string / number columns (what a prompt template can name; images are left out)."""
    return {key: value for key, value in row.items()
            if isinstance(key, str) and isinstance(value, (str, int, float, bool)) and key != "rubric"}


def meta_update(rubric: str, samples: Sequence[Mapping[str, Any]], backend: Any, *, num_samples: int,
                rng: random.Random, analyze_prompt: str = DEFAULT_ANALYZE_PROMPT,
                merge_prompt: str = DEFAULT_MERGE_PROMPT) -> tuple[str | None, list[dict[str, Any]]]:
    """One MPO rubric update: rubric_{k+1} from rubric_k and gathered samples (module docstring, steps 1-3).

    Args:
        rubric: the current rubric text.
        samples: dicts with ``prompt``, ``completion``, ``score`` (None: not applicable) and row columns.
        backend: the meta judge (``generate(texts, images) -> list[str | Exception]``).
        num_samples: how many samples the meta judge reads (all of them when fewer were gathered).
        rng: draws the samples (``random.sample``, as the official).

    Returns:
        (the new rubric, or None when the meta judge gave no criteria) and one log per sample read
        (its fields, the analysis reply and the criteria it proposed).
    """
    if not samples:
        return None, []
    chosen = rng.sample(range(len(samples)), min(num_samples, len(samples)))
    requests = []
    for index in chosen:
        sample = samples[index]
        values = {**sample, "rubric": rubric, "score": "n/a" if sample.get("score") is None else sample["score"]}
        requests.append(analyze_prompt.format_map(values))
    replies = backend.generate(requests, [[] for _ in requests])
    refined: list[list[str]] = []
    logs = []
    for index, reply in zip(chosen, replies):
        items = rubric_items(reply) if isinstance(reply, str) else []
        if items:
            refined.append(items)
        logs.append({**samples[index], "meta_reply": reply if isinstance(reply, str) else f"<failed: {reply}>",
                     "proposed_items": items})
    if not refined:
        return None, logs
    sets = "\n===\n".join(f"Scoring criteria set #{n + 1}:\n" + "\n".join(f"<item>{i}</item>" for i in items)
                          for n, items in enumerate(refined))
    (merged_reply,) = backend.generate([merge_prompt.format_map({"sets": sets})], [[]])
    merged = merge_items([rubric_items(merged_reply)]) if isinstance(merged_reply, str) else []
    if not merged:
        return None, logs
    return format_rubric(merged), logs


class MPOModule(CheckpointedState, GRPOModule):
    """GRPO rewarded by a rubric-conditioned judge whose rubric a meta judge rewrites every ``mpo_interval``
    batches (module docstring).

    Args:
        model_path: saved HF model directory.
        mpo_judge: the ``rewards.models`` judge scored with the rubric (its rubric template names ``{rubric}``).
        mpo_meta_judge: settings of the meta judge (a ``kind: judge`` entry of mmpo.rewards.models: ``url``,
            ``path`` or ``backend``, and its generation settings; its rubric and score settings are unused).
        mpo_initial_rubric: rubric_0 (official: ``evaluation_rubric_iter_0.txt`` / ``init_rm_prompt``).
        mpo_interval: batches between rubric updates (official ``num_mpo_interval`` 10).
        mpo_samples: samples the meta judge reads per update (official ``num_mpo_samples`` 20).
        mpo_analyze_prompt, mpo_merge_prompt: the meta judge's templates (:data:`DEFAULT_ANALYZE_PROMPT`,
            :data:`DEFAULT_MERGE_PROMPT`).
        mpo_oracle: a reward name logged as ``mpo/oracle_mean`` and never trained on (a testbed's hidden oracle).
        mpo_rubric_dir: where every rubric is written as ``evaluation_rubric_iter_<k>.txt`` (None: not written).
        **kwargs: every :class:`GRPOModule` setting.

    Metrics: ``mpo/rubric_iteration``, ``mpo/rubric_items``, ``mpo/failed_updates``, ``mpo/oracle_mean``.
    """

    checkpointed_state = (("mpo_rubric", "rubric_state"),)

    def __init__(
        self,
        model_path: str,
        *,
        mpo_judge: str = "judge",
        mpo_meta_judge: dict[str, Any] | None = None,
        mpo_initial_rubric: str = "",
        mpo_interval: int = 10,
        mpo_samples: int = 20,
        mpo_analyze_prompt: str = DEFAULT_ANALYZE_PROMPT,
        mpo_merge_prompt: str = DEFAULT_MERGE_PROMPT,
        mpo_oracle: str | None = None,
        mpo_rubric_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        require(mpo_interval >= 1, f"mpo_interval must be >= 1, got {mpo_interval}")
        require(mpo_samples >= 1, f"mpo_samples must be >= 1, got {mpo_samples}")
        require(bool(rubric_items(mpo_initial_rubric)),
                "mpo_initial_rubric must hold at least one <item>criterion</item>")
        require(mpo_meta_judge is not None, "mpo_meta_judge: give the meta judge's settings (url, path or backend)")
        super().__init__(model_path, **kwargs)
        models = self.rewards.models or {}
        require(mpo_judge in models and mpo_judge in self.reward_weights,
                f"mpo_judge {mpo_judge!r} must be a weighted entry of rewards.models (have {sorted(models)})")
        from mmpo.rewards.models import parse_spec, rubric_fields
        from mmpo.rewards.models import make_judge_backend

        judge_spec = parse_spec(mpo_judge, models[mpo_judge])
        require(judge_spec.kind == "judge" and "rubric" in rubric_fields(judge_spec.rubric),
                f"rewards.models.{mpo_judge}: an MPO judge's rubric template must name {{rubric}}")
        meta_spec = parse_spec("mpo_meta_judge", {"kind": "judge", **dict(mpo_meta_judge)})
        self.meta_backend = make_judge_backend("mpo_meta_judge", meta_spec)
        if mpo_oracle is not None:
            from mmpo.rewards.user import resolve_reward

            resolve_reward(mpo_oracle)
        self.rubric_state = RubricState(format_rubric(rubric_items(mpo_initial_rubric)))
        self._last_judged: tuple[list[str], list[dict[str, Any]], list[float | None]] | None = None
        self._write_rubric()

    # ------------------------------------------------------------------ rewards

    def compute_rewards(self, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        """The weighted rewards with the current rubric in every row's ``rubric`` column."""
        from mmpo.rewards import compute_rewards

        h = self.hparams
        state = self.rubric_state
        rows = [{**row, "rubric": state.rubric} for row in rollout.rows]
        total, per_fn, metrics = compute_rewards(self.reward_weights, rollout.texts, rows,
                                                 timeout_s=self.rewards.timeout_s)
        self._reward_parts = (rollout.texts, per_fn)
        judged = per_fn[h.mpo_judge].tolist()
        scores = [None if value != value else float(value) for value in judged]  # NaN = not applicable
        self._last_judged = (list(rollout.texts), [_plain_columns(row) for row in rollout.rows], scores)
        if h.mpo_oracle is not None:
            _, oracle, _ = compute_rewards({h.mpo_oracle: 1.0}, rollout.texts, list(rollout.rows),
                                           timeout_s=self.rewards.timeout_s)
            metrics["mpo/oracle_mean"] = float(oracle[h.mpo_oracle].nanmean()) if len(rollout.texts) else 0.0
        metrics["mpo/rubric_iteration"] = float(state.iteration)
        metrics["mpo/rubric_items"] = float(len(rubric_items(state.rubric)))
        return total, metrics

    # ------------------------------------------------------------------ the rubric update

    def end_step(self, state: StepState) -> None:
        """Gather the step's judged samples; every ``mpo_interval`` batches the meta judge writes rubric_{k+1}."""
        super().end_step(state)
        h = self.hparams
        rubric = self.rubric_state
        if self._last_judged is not None:
            texts, rows, scores = self._last_judged
            rubric.samples.extend({**row, "prompt": str(row.get("problem", "")), "completion": text, "score": score}
                                  for text, row, score in zip(texts, rows, scores))
            self._last_judged = None
        rubric.batches += 1
        if is_update_batch(rubric.batches, h.mpo_interval):
            rng = random.Random(h.seed * 1_000_003 + rubric.batches)  # the same draw on resume
            new, _ = meta_update(rubric.rubric, rubric.samples, self.meta_backend, num_samples=h.mpo_samples,
                                 rng=rng, analyze_prompt=h.mpo_analyze_prompt, merge_prompt=h.mpo_merge_prompt)
            rubric.samples = []  # the official clears its gatherings after every update
            if new is None:
                rubric.failed_updates += 1
            else:
                rubric.rubric = new
                rubric.iteration += 1
                self._write_rubric()
        state.metrics["mpo/failed_updates"] = float(rubric.failed_updates)

    def _write_rubric(self) -> None:
        directory = self.hparams.mpo_rubric_dir
        if directory is None:
            return
        from mmpo.files import atomic_write_text

        Path(directory).mkdir(parents=True, exist_ok=True)
        path = Path(directory) / f"evaluation_rubric_iter_{self.rubric_state.iteration}.txt"
        atomic_write_text(path, self.rubric_state.rubric.strip() + "\n")
