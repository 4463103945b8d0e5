"""Regenerate algos_golden.json: one real training step of each VLM algorithm on a fixed tiny batch.

Each algorithm (PAPO-G, PAPO-D, MAPO, StepGRPO, GCPO, AHPO) runs one Lightning training step
of its module on a seeded tiny Qwen2.5-VL (float64): seeded sampling, scripted rewards or
scripted completion texts (so every group has signal), mu = 2 inner epochs (so old log-probs
and clipping matter) and SGD(lr=1) without gradient clipping, so the weight change is exactly
minus the sum of the two steps' gradients. Stored: every logged metric of the step (loss parts,
clip fractions, the algorithm's own metrics) and, per parameter, a gradient fingerprint (sum,
sum of squares and a fixed random projection of the weight change). ``tests/algos/test_golden.py``
recomputes everything and compares, so a silent formula change fails. Regenerate only for an
intended change of a formula, and say so in the commit message:

    python tests/algos/golden/make_golden.py            # every algorithm
    python tests/algos/golden/make_golden.py ahpo       # only these entries; the others are kept
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
from torch.utils.data import DataLoader

from mmpo.algos.ahpo import AHPOModule
from mmpo.algos.gcpo import GCPOModule
from mmpo.algos.mapo import MAPOModule
from mmpo.algos.papo import PAPOModule
from mmpo.algos.stepgrpo import StepGRPOModule
from mmpo.data import STEPS_SYSTEM_PROMPT, SYSTEM_PROMPT, render_solution
from mmpo.data.synthetic import make_items
from mmpo.training.config import merged_settings
from mmpo.vlm.factory import build_tiny_vlm

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/: golden_support
from golden_support import gradient_fingerprint  # noqa: E402

GOLDEN_PATH = HERE / "algos_golden.json"
# Timings and the learning rate say nothing about the math.
UNCHECKED_PREFIXES = ("perf/", "lr")
COMMON = dict(sampling={"num_generations": 3, "max_new_tokens": 4}, optim={"mu": 2, "max_grad_norm": 0.0},
              rewards={"timeout_s": None}, dtype="float64")


def build_model(root: Path) -> Path:
    """The seeded tiny VLM every algorithm starts from."""
    import mmpo.data.geometry_aux  # noqa: F401  (registers the geometry_aux task)

    corpus = [SYSTEM_PROMPT, STEPS_SYSTEM_PROMPT, "<think> </think><answer> </answer> <auxiliary></auxiliary>",
              *(r["problem"] for r in make_items("count_shapes", 4, seed=0)),
              *(r["problem"] for r in make_items("geometry_aux", 4, seed=0))]
    return build_tiny_vlm(root, corpus=corpus, vocab_size=400, hidden_size=32, intermediate_size=64, seed=0)


def _gcpo_text(row: dict[str, Any], aux: bool, correct: bool) -> str:
    construction = "<auxiliary>Draw a line through C parallel to AB.</auxiliary> " if aux else ""
    answer = row["answer"] if correct else f"{row['answer']}1"
    return f"<think>{construction}step.</think><answer>{answer}</answer>"


def _scripted(cls: type, *, rewards: list[float] | None = None,
              texts: Callable[[int, dict[str, Any]], str] | None = None) -> type:
    """``cls`` with SGD(lr=1), and scripted rewards (replacing the reward functions) or scripted
    completion texts (scored by the algorithm's own reward functions)."""

    class Scripted(cls):
        def build_rollout(self, rows):
            rollout = super().build_rollout(rows)
            if texts is not None:
                rollout.texts = [texts(i, row) for i, row in enumerate(rollout.rows)]
            return rollout

        def compute_rewards(self, rollout):
            if rewards is None:
                return super().compute_rewards(rollout)
            return torch.tensor(rewards[: len(rollout)], dtype=torch.float64), {}

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=1.0)

    Scripted.__name__ = f"Scripted{cls.__name__}"
    return Scripted


def _steps_text(i: int, row: dict[str, Any]) -> str:
    return [render_solution(row, "steps"), "### Step 1: guess\n### The final answer is: 0", "no steps"][i % 3]


def _gcpo_texts(i: int, row: dict[str, Any]) -> str:
    aux, correct = [(True, True), (False, False), (True, False), (False, True), (True, True), (False, True)][i]
    return _gcpo_text(row, aux, correct)


# name -> (module class, settings, task, how rewards come about)
ALGORITHMS: dict[str, tuple[type, dict[str, Any], str, dict[str, Any]]] = {
    "papo_g": (PAPOModule, dict(gamma=0.02, eta_orig=0.01, eta_masked=0.01,
                                loss={"beta": 0.01, "clip_low": 0.2, "clip_high": 0.3}),
               "count_shapes", dict(rewards=[1.0, 0.0, 0.5, 0.0, 1.0, 1.0])),
    "papo_d": (PAPOModule, dict(gamma=0.01, eta_orig=0.03, eta_masked=0.03,
                                loss={"beta": 0.0, "clip_low": 0.2, "clip_high": 0.28},
                                advantage={"dynamic_sampling": True}),
               "count_shapes", dict(rewards=[1.0, 0.0, 0.1, 1.0, 1.0, 1.0])),  # group 1 constant: masked
    "mapo": (MAPOModule, dict(loss={"beta": 0.01, "clip_low": 0.2, "clip_high": 0.3}),
             "count_shapes", dict(rewards=[1.0, 0.0, 0.0, 1.0, 0.1, 1.0])),
    "stepgrpo": (StepGRPOModule, dict(), "count_shapes", dict(texts=_steps_text)),
    "gcpo": (GCPOModule, dict(length_cap=8), "geometry_aux", dict(texts=_gcpo_texts)),
    "ahpo": (AHPOModule, dict(), "count_shapes", dict(rewards=[1.0, 0.0, 0.1, 1.0, 1.0, 0.0])),  # gate: prompt 0
}


def run(name: str, model_path: Path) -> dict[str, Any]:
    """One training step of algorithm ``name``: {"metrics": {...}, "grad": {param: [sum, sumsq, proj]}}."""
    cls, settings, task, script = ALGORITHMS[name]
    torch.manual_seed(0)
    module = _scripted(cls, **script)(str(model_path), **merged_settings(COMMON, settings))
    rows = make_items(task, 2, seed=0)
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(module, DataLoader([rows], batch_size=None, collate_fn=lambda x: x))
    metrics = {k: float(v) for k, v in module.last_metrics.items() if not k.startswith(UNCHECKED_PREFIXES)}
    grads = {n: gradient_fingerprint(before[n] - p.detach(), n) for n, p in module.model.named_parameters()}
    return {"metrics": dict(sorted(metrics.items())), "grad": grads}


def compute(model_path: Path) -> dict[str, Any]:
    return {name: run(name, model_path) for name in ALGORITHMS}


if __name__ == "__main__":
    torch.set_num_threads(1)
    only = sys.argv[1:]
    unknown = sorted(set(only) - set(ALGORITHMS))
    if unknown:
        raise SystemExit(f"unknown algorithm(s) {unknown}; valid: {sorted(ALGORITHMS)}")
    with tempfile.TemporaryDirectory() as tmp:
        model_path = build_model(Path(tmp) / "tiny")
        if only:
            payload = json.loads(GOLDEN_PATH.read_text())
            payload.update({name: run(name, model_path) for name in only})
        else:
            payload = compute(model_path)
    tmp_path = GOLDEN_PATH.with_suffix(".json.tmp")
    tmp_path.write_text(json.dumps(payload, indent=1) + "\n")
    tmp_path.replace(GOLDEN_PATH)  # atomic: a failed run leaves the committed artifact intact
    print(f"wrote {GOLDEN_PATH}")
