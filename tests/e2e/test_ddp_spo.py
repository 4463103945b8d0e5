"""SPO under DDP (2 CPU processes, gloo) keeps one tracker: every rank ends the step with the same
Beta tracker as one process that saw the whole batch, and the advantages are normalised over the
global batch (the official tracker lives on one driver process that sees every prompt)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus
from mmpo.vlm.factory import build_tiny_vlm

WORKER = textwrap.dedent(
    '''
    import json
    import sys
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from mmpo.algos.spo import SPOModule
    from mmpo.data.synthetic import make_items

    torch.set_num_threads(1)
    mode, model_path, out = sys.argv[1:4]
    ddp = mode == "ddp"
    rows = make_items("count_shapes", 4, seed=0)
    SCORES = dict(zip([r["id"] for r in rows], [1.0, 0.0, 1.0, 1.0]))  # scripted by prompt


    class FixedSPO(SPOModule):
        """A DDP rank trains on its half of the 4 prompts; one process on all of them."""

        advantages = {}

        def prioritized_rows(self, batch, step):
            return list(batch)[2 * self.global_rank : 2 * self.global_rank + 2] if ddp else list(batch)

        def compute_rewards(self, rollout):
            return torch.tensor([SCORES[r["id"]] for r in rollout.rows]), {}

        def compute_advantages(self, rewards, group_ids, rollout):
            adv, metrics = super().compute_advantages(rewards, group_ids, rollout)
            self.advantages.update({r["id"]: float(a) for r, a in zip(rollout.rows, adv)})
            return adv, metrics


    module = FixedSPO(model_path, sampling={"max_new_tokens": 4}, loss={"beta": 0.0}, rewards={"timeout_s": None})
    trainer = L.Trainer(accelerator="cpu", devices=2 if ddp else 1,
                        strategy="ddp_find_unused_parameters_true" if ddp else "auto", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(module, DataLoader([rows], batch_size=None, collate_fn=lambda x: x))
    state = module.tracker.state_dict()
    with open(f"{out}.{trainer.global_rank}.json", "w") as f:
        json.dump({"alpha": state["alpha"], "beta": state["beta"], "visits": state["visits"],
                   "responses": sorted(state["responses"]), "advantages": module.advantages}, f)
    '''
)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    texts = [SYSTEM_PROMPT, *corpus(["count_shapes"], n=20)]
    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=texts, vocab_size=300, hidden_size=32,
                              intermediate_size=64))


def _run(tmp_path, mode, tiny_path) -> list[dict]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / mode
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, str(script), mode, tiny_path, str(out)], env=env,
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(path.read_text()) for path in sorted(tmp_path.glob(f"{mode}.*.json"))]


def test_ddp_ranks_share_one_tracker(tiny_path, tmp_path):
    (single,) = _run(tmp_path, "single", tiny_path)
    ranks = _run(tmp_path, "ddp", tiny_path)
    assert len(ranks) == 2
    # first visits: rho = 0.96, alpha = 0.96 * 0.5 + r -> 1.48 for a success, 0.48 for a failure
    assert sorted(single["alpha"].values()) == pytest.approx([0.48, 1.48, 1.48, 1.48])
    for rank in ranks:
        assert rank["alpha"] == pytest.approx(single["alpha"]) and rank["beta"] == pytest.approx(single["beta"])
        assert rank["visits"] == single["visits"] and rank["responses"] == single["responses"]
    # each rank normalised its two advantages with the global batch's statistics: r - 0.5 over the 4 prompts
    # is (0.5, -0.5, 0.5, 0.5): mean 0.25, std 0.5 -> +-0.5 for a success, -1.5 for the failure
    merged = {**ranks[0]["advantages"], **ranks[1]["advantages"]}
    assert merged == pytest.approx(single["advantages"], abs=1e-6)
    assert sorted(single["advantages"].values()) == pytest.approx([-1.5, 0.5, 0.5, 0.5], abs=1e-6)
