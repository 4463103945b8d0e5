"""The GCPO synthetic geometry task ``geometry_aux``: registration, answers, where the construction appears."""

from __future__ import annotations

import mmpo.data.geometry_aux  # noqa: F401  (registers the task)
from mmpo.data import render_solution
from mmpo.data.synthetic import TASKS, make_items
from mmpo.rewards import accuracy_reward, format_reward
from mmpo.rewards.gcpo import detect_auxiliary_tag


def test_registered_deterministic_and_disjoint_splits():
    assert "geometry_aux" in TASKS
    a = make_items("geometry_aux", 12, seed=3)
    b = make_items("geometry_aux", 12, seed=3)
    assert [r["problem"] + r["answer"] for r in a] == [r["problem"] + r["answer"] for r in b]
    test = make_items("geometry_aux", 12, seed=3, split="test")
    train_keys = {(r["problem"], r["answer"], r["images"][0].tobytes()) for r in a}
    assert not any((r["problem"], r["answer"], r["images"][0].tobytes()) in train_keys for r in test)


def test_both_kinds_with_correct_answers_and_construction_only_where_it_helps():
    rows = make_items("geometry_aux", 60, seed=0)
    kinds = [r["aux_helps"] for r in rows]
    assert 10 < sum(kinds) < 50  # both kinds present
    for row in rows:
        # the reference steps state the two angles; recover a, b to check the answer
        a, b = (int(x) for x in row["steps"][0].rstrip(".").split(" are ")[1].split(" and "))
        expected = a + b if row["aux_helps"] else 180 - a - b
        assert row["answer"] == str(expected), row["id"]
        solution = render_solution(row)
        assert detect_auxiliary_tag(solution) is row["aux_helps"], row["id"]
    solutions = [render_solution(r) for r in rows]
    # the reference solutions are well-formed and correct under the shared rewards
    assert format_reward(solutions, rows).tolist() == [1.0] * len(rows)
    assert accuracy_reward(solutions, rows).tolist() == [1.0] * len(rows)
