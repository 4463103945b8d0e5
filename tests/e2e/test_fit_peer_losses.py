"""Each verl / TRL loss and KL name trains 2 steps through `mmpo fit -c configs/vlm/grpo_tiny.yaml`."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import yaml

from tiny_vlm_support import tiny_grpo_fit_args

from mmpo.cli import main
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus
from mmpo.vlm.factory import build_tiny_vlm

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "vlm" / "grpo_tiny.yaml"

# (loss, kl_kind, loss-specific metric): every new KL name rides along with one loss
CASES = [
    ("sapo", "low_var_kl", None),
    ("gpg", "abs", None),
    ("clip_cov", "mse", "policy/clipfrac_cov"),
    ("kl_cov", "kl", "policy/kl_cov_frac"),
    ("luspo", "k3+", None),
    ("vespo", "k1", None),
]
TAKES_CLIP = {"clip_cov", "luspo"}  # the others have no clip range: grpo_tiny's clip_low / clip_high must go


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    texts = [SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)]
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=texts, vocab_size=400, hidden_size=64,
                          intermediate_size=128)


@pytest.mark.parametrize(("loss", "kl_kind", "metric"), CASES)
def test_peer_loss_trains_two_steps(tiny_path, tmp_path, loss, kl_kind, metric):
    clip = [] if loss in TAKES_CLIP else ["--model.init_args.loss.clip_low=null",
                                          "--model.init_args.loss.clip_high=null"]
    assert main(tiny_grpo_fit_args(CONFIG, tiny_path, tmp_path, "--model.init_args.loss.beta=0.01",
                                   f"--model.init_args.loss.kl_kind={kl_kind}", f"--model.init_args.loss.name={loss}",
                                   *clip)) == 0
    (hparams,) = tmp_path.glob("**/hparams.yaml")
    saved = yaml.safe_load(hparams.read_text())
    assert (saved["loss"]["name"], saved["loss"]["kl_kind"]) == (loss, kl_kind)
    (path,) = tmp_path.glob("**/metrics.csv")
    rows = [r for r in csv.DictReader(path.open()) if r.get("losses/policy")]
    assert len(rows) == 2, "two optimizer steps logged"
    for row in rows:
        assert math.isfinite(float(row["losses/policy"])) and math.isfinite(float(row["losses/kl"]))
        if metric is not None:
            assert 0.0 <= float(row[metric]) <= 1.0
