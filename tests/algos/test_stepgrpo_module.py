"""StepGRPO as a module (R1-VL, arXiv 2503.12937): summed step rewards, missing key steps,
and an `mmpo fit` smoke run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import BatchFeature

from mmpo.data.synthetic import make_items
from mmpo.training.config import RewardConfig
from mmpo.vlm.rollout import Rollout


GOOD = ("### Image Description: shapes\n### Rationales: count\n### Step 1: 2 + 1 = 3\n"
        "### The final answer is: 3")
BAD_FORMAT = "### Step 1: 2 + 1 = 3\n### The final answer is: 4"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [r["problem"] for r in make_items("count_shapes", 10, seed=0)] + [GOOD]
    return build_tiny_vlm(tmp_path_factory.mktemp("stepgrpo_model"), corpus=corpus)


def _rollout(texts, rows):
    n = len(texts)
    return Rollout(rows=rows, group_ids=torch.zeros(n, dtype=torch.long), prompt_inputs=BatchFeature({}),
                   completion_ids=torch.zeros(n, 1, dtype=torch.long), completion_mask=torch.ones(n, 1, dtype=torch.long),
                   texts=texts)


def test_module_defaults_and_summed_rewards(tiny_model):
    from mmpo.algos.stepgrpo import StepGRPOModule
    from mmpo.data import STEPS_SYSTEM_PROMPT

    module = StepGRPOModule(str(tiny_model), rewards={"timeout_s": None})
    assert (module.sampling.num_generations, module.advantage.eps, module.loss.beta,
            module.sampling.temperature) == (4, 1e-4, 0.04, 1.2)
    # the checkpointed hparams hold the same groups as plain dicts
    assert module.hparams.sampling["temperature"] == 1.2 and module.hparams.loss["beta"] == 0.04
    assert module.engine.system_prompt == STEPS_SYSTEM_PROMPT
    row = {"id": "c1", "answer": "3", "key_steps": [["2 + 1 = 3"], ["circle"]]}
    total, metrics = module.compute_rewards(_rollout([GOOD, BAD_FORMAT], [row, row]))
    # GOOD: correct 1 + 0.1 * 1/2 (only "2 + 1 = 3" is in a Step) + valid 1 = 2.05
    # BAD_FORMAT: wrong 0 + 0.1 * 1/2 + invalid 0 = 0.05
    assert total.tolist() == pytest.approx([2.05, 0.05])
    assert metrics["stepgrpo/key_step_frac"] == pytest.approx(0.5)
    # group advantage with std eps 1e-4: +-(1.0 / (std + 1e-4)), std of [2.05, 0.05] = sqrt(2)
    adv, _ = module.compute_advantages(total, torch.zeros(2, dtype=torch.long), None)
    assert adv.tolist() == pytest.approx([1.0 / (2**0.5 + 1e-4), -1.0 / (2**0.5 + 1e-4)], rel=1e-5)


def test_missing_key_steps_error_or_counted_skip(tiny_model):
    from mmpo.algos.stepgrpo import StepGRPOModule

    rows = [{"id": "no-keys-1", "answer": "3", "key_steps": []}, {"id": "k", "answer": "3", "key_steps": [["2 + 1"]]}]
    strict = StepGRPOModule(str(tiny_model), rewards={"timeout_s": None})
    with pytest.raises(ValueError, match="no-keys-1"):
        strict.compute_rewards(_rollout([GOOD, GOOD], rows))
    lenient = StepGRPOModule(str(tiny_model), rewards={"timeout_s": None}, skip_missing_key_steps=True)
    total, metrics = lenient.compute_rewards(_rollout([GOOD, GOOD], rows))
    assert total.tolist() == pytest.approx([2.0, 2.1])
    assert metrics["stepgrpo/missing_key_steps"] == 1.0


def test_stepgrpo_fit_smoke(tiny_model, tmp_path, fit_vlm_config, monkeypatch):
    """The sampled texts are swapped for known ones before scoring: even completions are the row's
    reference solution in the steps style (StepRAR 1 + 0.1 x 1, StepRVR 1), odd ones a bare line
    (0 and 0), so every logged reward mean is known: (2.1 + 0) / 2 per step."""
    from mmpo.algos.stepgrpo import StepGRPOModule
    from mmpo.data import render_solution

    sample = StepGRPOModule.build_rollout

    def scripted_texts(self, rows):
        rollout = sample(self, rows)
        rollout.texts = [render_solution(row, "steps") if i % 2 == 0 else "no steps here"
                         for i, row in enumerate(rollout.rows)]
        return rollout

    monkeypatch.setattr(StepGRPOModule, "build_rollout", scripted_texts)
    rows = fit_vlm_config("stepgrpo_tiny.yaml", tiny_model, tmp_path, "--model.init_args.sampling.num_generations=2")
    logged = [{k: float(v) for k, v in r.items() if v not in (None, "")} for r in rows if r.get("rewards/step_rvr/mean")]
    assert len(logged) == 2
    for m in logged:
        assert m["rewards/step_rar/mean"] == pytest.approx((1.0 + 0.1) / 2)
        assert m["rewards/step_rvr/mean"] == pytest.approx(0.5)
        assert m["rewards/total/mean"] == pytest.approx(2.1 / 2)  # weights 1 and 1 (paper)
        assert m["stepgrpo/key_step_frac"] == pytest.approx(0.5)
        assert m["stepgrpo/missing_key_steps"] == 0.0  # every synthetic row carries key steps
