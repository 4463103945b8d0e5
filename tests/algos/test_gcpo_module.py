"""GCPO as a module (GeometryZero, arXiv 2506.07160): rewards + mask on a hand-built rollout,
and an `mmpo fit` smoke run on the geometry_aux task."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import BatchFeature

from mmpo.data.synthetic import make_items
from mmpo.training.config import RewardConfig, SamplingConfig
from mmpo.vlm.rollout import Rollout


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    import mmpo.data.geometry_aux  # noqa: F401
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [r["problem"] for r in make_items("geometry_aux", 10, seed=0)] + ["<auxiliary></auxiliary>"]
    return build_tiny_vlm(tmp_path_factory.mktemp("gcpo_model"), corpus=corpus)


def _text(aux: bool, answer: str) -> str:
    construction = "<auxiliary>Draw a line through C parallel to AB.</auxiliary> " if aux else ""
    return f"<think>{construction}60 + 40 = 100.</think><answer>{answer}</answer>"


def test_module_rewards_with_contrastive_mask_hand_computed(tiny_model):
    from mmpo.algos.gcpo import GCPOModule

    module = GCPOModule(str(tiny_model), sampling={"num_generations": 4},
                        rewards=RewardConfig(timeout_s=None), length_cap=10)
    row_a = {"id": "ext-1", "answer": "100", "aux_helps": True}
    row_b = {"id": "int-1", "answer": "80", "aux_helps": False}
    # prompt A: aux rollouts right, plain ones wrong -> M = +1; prompt B: aux wrong, plain right -> M = -1
    texts = [_text(True, "100"), _text(True, "100"), _text(False, "90"), _text(False, "100"),
             _text(True, "70"), _text(False, "80"), _text(False, "80"), _text(True, "80")]
    rows = [row_a] * 4 + [row_b] * 4
    lengths = torch.tensor([10, 5, 0, 20, 10, 10, 10, 10])  # T; R_len = 0.5 * min(T, 10) / 10
    mask = (torch.arange(20)[None, :] < lengths[:, None]).long()
    rollout = Rollout(rows=rows, group_ids=torch.arange(2).repeat_interleave(4), prompt_inputs=BatchFeature({}),
                      completion_ids=torch.zeros(8, 20, dtype=torch.long), completion_mask=mask, texts=texts)
    total, metrics = module.compute_rewards(rollout)
    # A: acc_aux = 1, acc_no = 0.5 -> M = +1.  R = acc + 0.5 fmt + M * 0.5 aux + len
    #   [1 + .5 + .5 + .5, 1 + .5 + .5 + .25, 0 + .5 + 0 + 0, 1 + .5 + 0 + .5]
    # B: acc_aux = 0.5, acc_no = 1 -> M = -1
    #   [0 + .5 - .5 + .5, 1 + .5 + 0 + .5, 1 + .5 + 0 + .5, 1 + .5 - .5 + .5]
    assert total.tolist() == pytest.approx([2.5, 2.25, 0.5, 2.0, 0.5, 2.0, 2.0, 1.5])
    assert metrics["gcpo/mask_pos_frac"] == 0.5 and metrics["gcpo/mask_neg_frac"] == 0.5
    assert metrics["gcpo/aux_rate_helps"] == pytest.approx(0.5)
    assert metrics["gcpo/aux_rate_not_helps"] == pytest.approx(0.5)
    # the ablation without the mask rewards every construction: B's aux rollouts get +0.5
    plain = GCPOModule(str(tiny_model), sampling={"num_generations": 4},
                       rewards=RewardConfig(timeout_s=None), length_cap=10, contrastive_mask=False)
    total_plain, _ = plain.compute_rewards(rollout)
    assert total_plain.tolist() == pytest.approx([2.5, 2.25, 0.5, 2.0, 1.5, 2.0, 2.0, 2.5])


def test_gcpo_fit_smoke(tiny_model, tmp_path, fit_vlm_config):
    rows = fit_vlm_config("gcpo_tiny.yaml", tiny_model, tmp_path, "--model.init_args.sampling.num_generations=2")
    logged = [{k: float(v) for k, v in r.items() if v not in (None, "")} for r in rows if r.get("gcpo/mask_pos_frac")]
    assert len(logged) == 2
    for m in logged:
        # R_len = 0.5 min(T, 900) / 900 and T <= max_new_tokens (6) < 900: its mean follows the mean length
        assert m["rewards/gcpo_length/mean"] == pytest.approx(0.5 * m["response/length_mean"] / 900, rel=1e-5)
        # R = 1.0 acc + 0.5 fmt + M R_aux + R_len, so the means add up with the config's weights
        expected = (m["rewards/accuracy/mean"] + 0.5 * m["rewards/format/mean"] + m["rewards/gcpo_aux_masked/mean"]
                    + m["rewards/gcpo_length/mean"])
        assert m["rewards/total/mean"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
        # two prompts per step: each mask fraction counts prompts (0, 1/2 or 1), never rollouts
        for key in ("pos", "neg", "zero"):
            assert m[f"gcpo/mask_{key}_frac"] in (0.0, 0.5, 1.0), key
