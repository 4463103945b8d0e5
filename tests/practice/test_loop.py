"""The Training-Free GRPO loop and ``mmpo practice`` on the tiny text LM: frozen weights, versioned library
snapshots, exact resume, no overwriting, and configs/practice/training_free_grpo_tiny.yaml end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmpo.cli import main
from mmpo.practice.loop import PracticeConfig, TrainingFreeGRPO, epoch_order
from mmpo.vlm.factory import build_tiny_text_lm, load_vlm

ROOT = Path(__file__).resolve().parents[2]
REWARD = {f"{Path(__file__).with_name('reward_parity.py')}:parity": 1.0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "text"
    build_tiny_text_lm(path, vocab_size=400, hidden_size=32, intermediate_size=64, num_layers=1)
    return path


def _config(tiny, out, **kw):
    options = dict(model_path=str(tiny), output_dir=str(out), tasks=["long_arithmetic", "word_problem"],
                   train_size=3, epochs=2, batch_size=2, grpo_n=3, max_new_tokens=8, extractor="rules",
                   rewards=REWARD, num_experiences_per_query=1)
    return PracticeConfig(**{**options, **kw})


def test_epoch_order():
    assert epoch_order(4, 0, seed=0, shuffle=False) == [0, 1, 2, 3]
    assert sorted(epoch_order(6, 1, seed=0, shuffle=True)) == list(range(6))
    assert epoch_order(6, 1, seed=0, shuffle=True) != epoch_order(6, 2, seed=0, shuffle=True)


def test_loop_freezes_weights_versions_the_library_and_resumes_exactly(tiny, tmp_path):
    policy = load_vlm(tiny)
    before = [p.clone() for p in policy[0].parameters()]
    full = TrainingFreeGRPO(_config(tiny, tmp_path / "full"), policy=policy).run(progress=False)
    # 6 problems / batch 2 -> 3 batches x 2 epochs
    assert full["next_step"] == 6 and [h["step"] for h in full["history"]] == list(range(6))
    assert all(torch.equal(a, b) for a, b in zip(before, policy[0].parameters()))
    snapshots = sorted((tmp_path / "full" / "library").glob("step_*.json"))
    assert [json.loads(p.read_text())["version"] for p in snapshots] == [1, 2, 3, 4, 5, 6]
    latest = json.loads((tmp_path / "full" / "experiences.json").read_text())
    assert latest["experiences"] == full["experiences"] and latest["version"] == 6
    # the rule extractor keeps one experience per task name that appeared in a mixed group
    names = {text.split(":")[0] for text in full["experiences"].values()}
    assert names <= {"long_arithmetic", "word_problem"} and len(names) == len(full["experiences"])
    for record in full["history"]:  # every group is either used or all-wrong / all-right
        assert record["groups_used"] + record["all_wrong_groups"] + record["all_right_groups"] == 2

    # stopped after 2 steps, then resumed: the same history and library as the uninterrupted run
    runner = TrainingFreeGRPO(_config(tiny, tmp_path / "split"), policy=policy)
    assert runner.run(progress=False, stop_after=2)["next_step"] == 2
    with pytest.raises(ValueError, match="pass --resume to continue it or --overwrite"):
        TrainingFreeGRPO(_config(tiny, tmp_path / "split"), policy=policy).run(progress=False)
    with pytest.raises(ValueError, match="config differs in grpo_n"):
        TrainingFreeGRPO(_config(tiny, tmp_path / "split", grpo_n=2), policy=policy).run(progress=False, resume=True)
    resumed = TrainingFreeGRPO(_config(tiny, tmp_path / "split"), policy=policy).run(progress=False, resume=True)
    assert resumed["history"] == full["history"] and resumed["experiences"] == full["experiences"]


def test_foreign_output_dir_is_refused(tiny, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="is not a practice run"):
        TrainingFreeGRPO(_config(tiny, tmp_path / "busy"), policy=load_vlm(tiny)).run(progress=False)
    assert (tmp_path / "busy" / "keep.txt").read_text() == "x"


def test_tiny_config_through_the_cli(tiny, tmp_path, capsys):
    out = tmp_path / "practice"
    args = ["practice", "-c", str(ROOT / "configs" / "practice" / "training_free_grpo_tiny.yaml"),
            f"--model_path={tiny}", f"--output_dir={out}", f"--rewards={json.dumps(REWARD)}", "--no_progress"]
    assert main(args) == 0
    state = json.loads((out / "state.json").read_text())
    assert state["next_step"] == state["total_steps"] == 4  # 8 problems / batch 4 x 2 epochs
    assert state["config"]["grpo_n"] == 5 and state["config"]["temperature"] == 0.7
    heldout = json.loads((out / "heldout.json").read_text())
    assert heldout["num_items"] == 4 and set(heldout) == {"num_items", "library_size", "with_library",
                                                          "without_library"}
    deployed = (out / "system_prompt.txt").read_text()
    from mmpo.data import SYSTEM_PROMPT
    from mmpo.practice.experience import system_with_experiences
    assert deployed == system_with_experiences(SYSTEM_PROMPT, state["experiences"])
    assert main(args) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert main([*args, "--resume"]) == 0  # finished: nothing left to do, nothing rewritten
    assert json.loads((out / "state.json").read_text()) == state
    assert main([*args, "--resume", "--overwrite"]) == 2
    capsys.readouterr()
    assert main([*args, "--tasks=[nope]"]) == 2
    assert capsys.readouterr().err.startswith("mmpo practice: error: unknown synthetic task 'nope'")
    assert main([*args[:3], f"--model_path={tmp_path / 'none'}", f"--output_dir={tmp_path / 'o'}"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_the_policy_as_its_own_extractor(tiny, tmp_path):
    """extractor: policy: the frozen tiny LM answers the four prompts; its unreadable answers change nothing."""
    config = _config(tiny, tmp_path / "self", extractor="policy", epochs=1, train_size=1, max_new_tokens=4)
    state = TrainingFreeGRPO(config).run(progress=False)
    (record,) = state["history"]
    assert record["groups_with_experiences"] == 0
    # random weights write no <Experiences> block, so no operation is proposed and the library stays empty
    assert record["proposed_operations"] == 0 and state["experiences"] == {}
