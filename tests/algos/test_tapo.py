"""TAPO (arXiv 2505.15692): template search, library, retrieval and mixed groups on hand values; the
`mmpo tapo-library` command and configs/vlm/tapo_tiny.yaml for 2 steps through `mmpo fit`."""

from __future__ import annotations

import json

import pytest
import torch

from mmpo.algos.tapo import (
    GUIDED_KEY,
    build_library,
    children,
    condition_complexity,
    render_template,
    retrieve,
    search_templates,
    tapo_metrics,
)

LIBRARY = {"format": "mmpo-tapo-library", "version": 1, "templates": [
    {"actions": ["SA", "CoT"], "complexity": 2, "value": 0.5, "count": 3},
    {"actions": ["DC"], "complexity": 2, "value": 0.75, "count": 1},
    {"actions": ["CoT"], "complexity": 5, "value": 1.0, "count": 9},
    {"actions": ["OST", "SRR"], "complexity": 0, "value": 0.25, "count": 1},
]}


def test_complexity_and_rendering():
    assert condition_complexity("Ben has 38 marbles, buys 3 packs of 9.5 each, loses -2.") == 4
    assert condition_complexity("How many triangles?") == 0
    assert render_template(["SA", "SRR"]) == (
        "Follow this thought template:\n1. System analysis: list the known conditions and state exactly what is "
        "asked.\n2. Self-reflection and refinement: check the result against the conditions and fix any error.")
    with pytest.raises(ValueError, match="non-empty sequence"):
        render_template(["XX"])


def test_tree_children_never_repeat_an_action():
    assert children((), ["A", "B"]) == [("A",), ("B",)]
    assert children(("A",), ["A", "B", "C"]) == [("A", "B"), ("A", "C")]


def test_beam_search_by_hand():
    # values: depth 1: A .2, B .5, C .4 -> beam 2 keeps B, C; depth 2 scores BA BC CA CB; (B, C) is best
    values = {("A",): .2, ("B",): .5, ("C",): .4, ("B", "A"): .1, ("B", "C"): .9, ("C", "A"): .5, ("C", "B"): .5}
    calls = []

    def score(node):
        calls.append(node)
        return values[node]

    ranked = search_templates(score, action_set=["A", "B", "C"], max_depth=2, beam=2)
    assert calls == [("A",), ("B",), ("C",), ("B", "A"), ("B", "C"), ("C", "A"), ("C", "B")]  # A never expanded
    assert ranked[:4] == [(("B", "C"), .9), (("B",), .5), (("C", "A"), .5), (("C", "B"), .5)]


def test_library_keeps_each_seed_problems_best_sequence():
    rows = [{"problem": "1 + 2"}, {"problem": "3 + 4"}, {"problem": "no numbers"}]
    # CoT best for the two-number problems, SA best for the other
    library = build_library(rows, lambda row, node: 1.0 if node == (("CoT",) if "+" in row["problem"] else ("SA",))
                            else 0.0, max_depth=1, beam=1)
    assert library["templates"] == [{"actions": ["SA"], "complexity": 0, "value": 1.0, "count": 1},
                                    {"actions": ["CoT"], "complexity": 2, "value": 1.0, "count": 2}]


def test_retrieval_by_hand():
    assert retrieve(LIBRARY, "add 1 and 2") == [["DC"]]  # complexity 2: DC (value .75) before SA-CoT (.5)
    # then the distance: |0 - 2| = 2 (OST-SRR) before |5 - 2| = 3 (CoT), whatever the values
    assert retrieve(LIBRARY, "add 1 and 2", k=3) == [["DC"], ["SA", "CoT"], ["OST", "SRR"]]
    assert retrieve(LIBRARY, "1 2 3 4 5 6") == [["CoT"]]
    assert retrieve(LIBRARY, "none") == [["OST", "SRR"]]


def test_metrics_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    guided = torch.tensor([True, False, False, False, True, False, False, False])
    out = tapo_metrics(rewards, groups, guided)
    assert out["tapo/guided_reward_mean"] == 0.5 and out["tapo/unguided_reward_mean"] == pytest.approx(2 / 6)
    # group 0's unguided rollouts are all wrong (its guided one is right): all-wrong 0 of 2 after mixing, 1 before
    assert out["tapo/all_wrong_group_frac"] == 0.0 and out["tapo/unguided_all_wrong_group_frac"] == 0.5


@pytest.fixture
def library_file(tmp_path):
    path = tmp_path / "library.json"
    path.write_text(json.dumps(LIBRARY))
    return path


def test_mixed_groups_on_the_tiny_model(tiny_model, library_file, hand_grpo_advantages):
    from mmpo.algos.tapo import TAPOModule
    from mmpo.data.synthetic import make_items

    module = TAPOModule(str(tiny_model), library=str(library_file), guided_per_group=2,
                        sampling={"num_generations": 3, "max_new_tokens": 3}, rewards={"timeout_s": None})
    rows = make_items("count_shapes", 2, seed=0)
    torch.manual_seed(0)
    rollout = module.build_rollout(rows)
    assert rollout.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert rollout.extras[GUIDED_KEY].tolist() == [True, True, False] * 2
    for i, row in enumerate(rollout.rows):
        source = rows[i // 3]
        template = retrieve(LIBRARY, source["problem"])[0]
        if i % 3 < 2:
            assert row["problem"] == render_template(template) + "\n\n" + source["problem"]
        else:
            assert row["problem"] == source["problem"]
        assert row["answer"] == source["answer"]
    # guided and unguided rollouts share one group normalisation
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    advantages, _ = module.compute_advantages(rewards, rollout.group_ids, rollout)
    assert torch.allclose(advantages, hand_grpo_advantages(rewards, 3), atol=1e-5)
    with pytest.raises(ValueError, match="guided_per_group"):
        TAPOModule(str(tiny_model), library=str(library_file), guided_per_group=4, sampling={"num_generations": 3})


def test_library_command_then_tapo_tiny_config(tiny_model, tmp_path, fit_vlm_config, capsys):
    from mmpo.cli import main

    out = tmp_path / "templates.json"
    args = ["tapo-library", "--model", str(tiny_model), "--tasks", "count_shapes", "--size", "2", "--out", str(out),
            "--samples", "1", "--max-depth", "1", "--beam", "1", "--max-new-tokens", "2"]
    assert main(args) == 0
    library = json.loads(out.read_text())
    assert sum(t["count"] for t in library["templates"]) == 2 and library["max_depth"] == 1
    assert all(len(t["actions"]) == 1 for t in library["templates"])
    assert main(args) == 2 and "pass --overwrite" in capsys.readouterr().err
    assert main([*args[:-10], "--tasks", "nope", "--out", str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err.startswith("mmpo tapo-library: error: unknown synthetic task 'nope'")
    rows = fit_vlm_config("tapo_tiny.yaml", tiny_model, tmp_path / "fit", f"--model.init_args.library={out}",
                          "--model.init_args.sampling.num_generations=3")
    logged = [r for r in rows if r.get("tapo/guided_reward_mean")]
    assert len(logged) == 2
    assert all(0.0 <= float(r["tapo/all_wrong_group_frac"]) <= 1.0 for r in logged)


def test_resume_matches_uninterrupted_run(tiny_model, library_file, tmp_path, scripted_reward):
    """1 + 1 TAPO steps straight == 1 step, a fresh Trainer from the checkpoint, 1 more (weights bit for bit)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from mmpo.algos.tapo import TAPOModule
    from mmpo.data.datamodule import PromptDataModule

    weights = scripted_reward([1.0, 0.0])  # guided right, unguided wrong: every group has a signal

    def module():
        return TAPOModule(str(tiny_model), library=str(library_file), guided_per_group=1, seed=5,
                          sampling={"num_generations": 2, "max_new_tokens": 3}, optim={"lr": 1e-3},
                          rewards={"timeout_s": None, "weights": weights})

    def data():
        return PromptDataModule(tasks=["count_shapes"], train_size=4, val_size=1, seed=3, batch_size=2)

    def trainer(root, steps, callbacks=()):
        return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, default_root_dir=root, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, callbacks=list(callbacks))

    straight = module()
    trainer(tmp_path / "a", 2).fit(straight, datamodule=data())
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True, save_top_k=-1)
    trainer(tmp_path / "b", 1, [checkpoint]).fit(module(), datamodule=data())
    resumed = module()
    trainer(tmp_path / "c", 2).fit(resumed, datamodule=data(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    expected = dict(straight.model.named_parameters())
    initial = dict(module().model.named_parameters())
    assert any(not torch.equal(p, initial[n]) for n, p in expected.items())  # the steps did train
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, expected[name]), name
    assert resumed.trainer.global_step == 2
