"""The rollout IS correction trains 2 steps through `mmpo fit -c configs/vlm/grpo_tiny.yaml`:
`--model.init_args.rollout_correction.mode=token_truncate` (TRL / verl decoupled) and verl's bypass mode."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from tiny_vlm_support import tiny_grpo_fit_args

from mmpo.cli import main
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus
from mmpo.vlm.factory import build_tiny_vlm

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "vlm" / "grpo_tiny.yaml"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    texts = [SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)]
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=texts, vocab_size=400, hidden_size=64,
                          intermediate_size=128)


@pytest.mark.parametrize("overrides", [
    ["--model.init_args.rollout_correction.mode=token_truncate"],
    ["--model.init_args.rollout_correction.mode=sequence_mask", "--model.init_args.rollout_correction.cap=3.0",
     "--model.init_args.optim.mu=2"],
    ["--model.init_args.rollout_correction.bypass=true"],
])
def test_rollout_correction_trains_two_steps(tiny_path, tmp_path, overrides):
    assert main(tiny_grpo_fit_args(CONFIG, tiny_path, tmp_path,
        *overrides)) == 0
    (path,) = tmp_path.glob("**/metrics.csv")
    rows = [r for r in csv.DictReader(path.open()) if r.get("losses/policy")]
    # mu = 2 makes both optimizer steps in one training step (one logged row, old log-probs recomputed)
    assert len(rows) == (1 if "--model.init_args.optim.mu=2" in overrides else 2)
    for row in rows:
        assert math.isfinite(float(row["losses/policy"]))
        # the engine samples with the vision tokens suppressed: pi_engine = pi_trainer / (1 - m), m the
        # trainer's probability of the 4 vision tokens (~1% on this random 400-token model), so each
        # pi_trainer / pi_engine is 1 - m, a little below 1 (HF generate and the trainer agree to ~1e-6);
        # the sequence modes' weight is the product over the <= 4 tokens (measured 0.990 token, 0.959 sequence)
        if "--model.init_args.rollout_correction.bypass=true" in overrides:
            # ratio pi_theta / pi_engine at the first pass
            assert 0.97 < float(row["policy/ratio_mean"]) < 1.0
        else:
            assert 0.9 < float(row["rollout_is/mean"]) < 1.0
            assert float(row["rollout_is/clipped_frac"]) == 0.0
            assert 0.0 < float(row["rollout_is/kl"]) < 0.03
