"""bench/bench_matpo_dialtree.py: the scripted warm-up traces solve their tasks (real tool / target answers), each
role's row carries the prompt its rollout shows, the RL arms differ only in the algorithm and group size, the
budget bookkeeping, and the paired contrasts of the report (hand-computed)."""

from __future__ import annotations

import json

import pytest
from bench_support import load_bench

from mmpo.algos.dialtree import LockTarget, code_revealed, split_turn
from mmpo.algos.matpo import DEFAULT_WORKER_SYSTEM_PROMPT, SUBAGENT_SCHEMA, worker_summary
from mmpo.data.synthetic import make_items
from mmpo.tools.lookup import city_of, population_of

bench = load_bench("bench_matpo_dialtree")
original_corpus = bench.tokenizer_corpus


def test_twohop_roles_and_traces():
    (row,) = make_items("twohop", 1, seed=3, split="train")
    single, planner, worker = bench.sft_rows("twohop", [row], summary_max_chars=120)
    assert [r["role"] for r in (single, planner, worker)] == ["single", "planner", "worker"]
    assert [s["function"]["name"] for s in single["tool_schemas"]] == ["lookup"]
    assert planner["tool_schemas"] == [SUBAGENT_SCHEMA] and "system_prompt" not in planner
    assert worker["system_prompt"] == DEFAULT_WORKER_SYSTEM_PROMPT
    assert [s["function"]["name"] for s in worker["tool_schemas"]] == ["lookup"]
    person = bench._person(row)
    assert row["problem"] == f"How many people live in the city where {person} lives?"
    assert f'"{bench.worker_subtask(person)}"' in worker["problem"]  # the worker_request layout
    city = city_of(person)
    population = str(population_of(city))
    assert population == row["answer"]
    # the worker looks up the person, then the city (real answers, distractors included), and summarises
    assert worker["tool_trace"][:4] == row["tool_trace"][:4]
    assert f"[match] {city} has {population} inhabitants." in worker["tool_trace"][3]["content"]
    summary = worker_summary(worker["tool_trace"][-1]["content"], max_chars=120)
    assert summary == f"{person} lives in {city}, which has {population} inhabitants."
    # the planner delegates the whole question once, reads the summary, answers
    call = json.loads(planner["tool_trace"][0]["content"].split("<tool_call>\n")[1].split("\n</tool_call>")[0])
    assert call == {"name": "subagent", "arguments": {"subtask": bench.worker_subtask(person)}}
    assert planner["tool_trace"][1] == {"role": "tool", "name": "subagent", "content": summary}
    assert planner["tool_trace"][2]["content"].endswith(f"<answer>{population}</answer>")
    # a short cut-off cuts the summary the planner sees, as the rollout does
    assert bench.planner_trace(row, summary_max_chars=10)[1]["content"] == summary[:10]


def test_lock_traces_succeed_against_the_scripted_target():
    rows = make_items("lock", 6, seed=0, split="train")  # difficulties 1, 2, 3, 1, 2, 3
    out = bench.sft_rows("lock", rows)
    assert [r["lock_greetings"] for r in out] == [1, 2, 1, 2]  # 3 greetings + a request do not fit 3 turns
    for row in out:
        trace = row["tool_trace"]
        assert row["problem"].startswith("Goal: ") and row["tool_schemas"] == []
        said = [split_turn(m["content"])[1] for m in trace if m["role"] == "assistant"]
        assert len(said) == row["lock_greetings"] + 1 and trace[-1]["role"] == "assistant"
        # the trace's target answers are the target's; the last request reveals the code
        for turn in range(len(said) - 1):
            assert trace[2 * turn + 1]["content"] == LockTarget()(said[:turn + 1], row)
        reveal = LockTarget()(said, row)
        dialogue = [{"role": "user", "content": row["problem"]}, {"role": "user", "content": reveal}]
        assert code_revealed(dialogue, row) == 1.0
        assert all(split_turn(m["content"])[0] for m in trace if m["role"] == "assistant")  # well-formed turns


def test_rl_arms_differ_only_in_algorithm_and_group_size():
    settings = bench.parse_settings("twohop", ["rl_steps=3", "context=99"])
    assert settings["rl_steps"] == 3 and settings["context"] == 99
    single_config, single = bench.rl_arguments("twohop", "single", settings)
    matpo_config, matpo = bench.rl_arguments("twohop", "matpo", settings)
    assert (single_config, matpo_config) == ("calc_grpo_tiny.yaml", "matpo_tiny.yaml")
    shared = {"--data.init_args.batch_size=2", "--model.init_args.agent.max_total_tokens=99",
              "--model.init_args.sampling.max_new_tokens=48", "--model.init_args.optim.lr=0.0003"}
    assert shared <= set(single) and shared <= set(matpo)
    assert "--model.init_args.sampling.num_generations=8" in single
    assert "--model.init_args.sampling.num_generations=4" in matpo
    lock = bench.parse_settings("lock", [])
    tree_config, tree = bench.rl_arguments("lock", "dialtree", lock)
    flat_config, flat = bench.rl_arguments("lock", "flat", lock)
    assert (tree_config, flat_config) == ("dialtree_tiny.yaml", "dialtree_flat_tiny.yaml")
    assert {"--model.init_args.dialtree.branching=3", "--model.init_args.dialtree.width=3"} <= set(tree)
    assert "--model.init_args.sampling.num_generations=3" in flat
    # the same maximal target budget: a tree queries 3 roots, then at most width per depth; flat 3 x 3 turns
    assert lock["branching"] + 2 * lock["width"] == lock["flat_g"] * 3 == 9
    with pytest.raises(ValueError, match="key=value"):
        bench.parse_settings("lock", ["no_such=1"])


def test_budget_bookkeeping(tmp_path):
    run = tmp_path / "run" / "version_0"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text("step,matpo/workers_per_planner,dialtree/target_queries\n"
                                     "0,1.0,\n1,0.5,7\n2,,8\n")
    logged = bench.logged_means(tmp_path / "run", ["matpo/workers_per_planner", "dialtree/target_queries", "x"])
    assert logged == {"matpo/workers_per_planner": 0.75, "dialtree/target_queries": 7.5, "x": None}
    settings = bench.parse_settings("twohop", [])
    # MATPO: 4 planners per question, 0.75 workers each -> 4 * 1.75 = 7 trajectories; single: G = 8
    assert bench.rollout_budget("twohop", "matpo", settings, logged) == {"trajectories": 7.0}
    assert bench.rollout_budget("twohop", "single", settings, logged) == {"trajectories": 8.0}
    lock = bench.rollout_budget("lock", "flat", settings, {"dialtree/leaves_per_goal": 3.0,
                                                           "dialtree/target_queries": 8.25})
    assert lock == {"trajectories": 3.0, "target_queries": 8.25}


def _seed(seed: int, a: list[float], b: list[float]) -> dict:
    return {"seed": seed, "settings": {}, "training": {"flat": {"dialtree/target_queries": 9.0},
                                                      "dialtree": {"dialtree/target_queries": 8.0}},
            "eval": {name: {"success_greedy": v, "success_sampled": v, "valid_greedy": v, "valid_sampled": v,
                            "success_rate_greedy": sum(v) / len(v), "success_rate_sampled": sum(v) / len(v),
                            "format_valid_rate_greedy": 1.0, "format_valid_rate_sampled": 1.0}
                     for name, v in (("dialtree", a), ("flat", b), ("sft", b))}}


def test_report_contrasts_are_paired_by_item_over_seeds(tmp_path):
    seeds = [_seed(0, [1, 1, 0, 0], [1, 0, 0, 0]), _seed(1, [1, 1, 1, 0], [0, 0, 0, 0])]
    row = bench.contrast_row(seeds, "dialtree", "flat", "success_greedy")
    # per seed: 0.5 - 0.25 = +0.25 and 0.75 - 0 = +0.75; the estimate is their mean, +0.5
    assert row["seeds"] == 2 and row["per_seed"] == [0.25, 0.75] and row["estimate"] == pytest.approx(0.5)
    low, high = row["seed_t"]  # t interval, 1 df: 0.5 +- 12.706 * 0.25 (sd 0.3536 / sqrt 2)
    assert low == pytest.approx(0.5 - 12.7062 * 0.25, abs=1e-3) and high == pytest.approx(0.5 + 12.7062 * 0.25,
                                                                                           abs=1e-3)
    for seed in seeds:
        path = tmp_path / "lock" / f"s{seed['seed']}" / "results.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(seed))
    text = bench.report(tmp_path)
    assert "| dialtree - flat | success_greedy | +0.500 | +0.250, +0.750 |" in text
    assert "| flat | " in text and (tmp_path / "report.md").read_text() == text
    broken = [_seed(0, [1, 1, 0], [1, 0, 0, 0])]
    with pytest.raises(ValueError, match="different item counts"):
        bench.contrast_row(broken, "dialtree", "flat", "success_greedy")


def test_lock_seed_end_to_end_and_resumable(tmp_path, monkeypatch):
    """One lock seed with tiny budgets: SFT, both RL arms through ``mmpo fit``, the evaluations on the same goals,
    the stored results; a second call runs nothing."""
    monkeypatch.setattr(bench, "MODEL_SIZE", dict(vocab_size=400, hidden_size=32, intermediate_size=64, num_layers=1))
    monkeypatch.setattr(bench, "RL_OVERRIDES", ["--data.init_args.train_size=8"])
    monkeypatch.setattr(bench, "tokenizer_corpus", lambda: original_corpus(20))
    settings = bench.parse_settings("lock", ["sft_steps=2", "sft_rows=12", "sft_batch=4", "rl_steps=1", "questions=2",
                                             "max_new_tokens=8", "eval_size=3", "samples=2"])
    results = bench.run_seed("lock", 0, tmp_path, settings)
    assert set(results["eval"]) == {"sft", "flat", "dialtree"}
    for entry in results["eval"].values():
        assert len(entry["success_sampled"]) == len(entry["valid_greedy"]) == 3
        assert entry["ids"] == results["eval"]["sft"]["ids"]  # the same held-out goals for every checkpoint
        assert entry["success_rate_sampled"] == pytest.approx(sum(entry["success_sampled"]) / 3)
    assert results["training"]["flat"]["trajectories"] == 3.0  # flat_g dialogues per goal
    assert results["training"]["dialtree"]["target_queries"] <= 9.0
    stored = json.loads((tmp_path / "lock" / "s0" / "results.json").read_text())
    assert stored == json.loads(json.dumps(results))

    def no_more_work(*args, **kwargs):
        raise AssertionError("a finished stage ran again")

    for name in ("train_sft", "_fit", "evaluate_lock"):
        monkeypatch.setattr(bench, name, no_more_work)
    assert bench.run_seed("lock", 0, tmp_path, settings)["eval"] == results["eval"]

