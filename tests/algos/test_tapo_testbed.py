"""The TAPO testbed (mmpo.algos.tapo_testbed, the strategy_mix task): generator, reward, the weak start's training
targets, and the library search / retrieval on it with a scripted scorer (values worked out by hand)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from mmpo.algos.tapo import build_library, condition_complexity, guided_problem, retrieve
from mmpo.algos.tapo_testbed import (
    ACTION_PROCEDURES,
    answer_text,
    random_template,
    sft_example,
    weak_start_procedure,
)
from mmpo.data.synthetic import make_items
from mmpo.data.synthetic.strategy_tasks import (
    FAMILIES,
    PROCEDURES,
    apply_procedure,
    family_of,
    problem_values,
    strategy_problem,
)
from mmpo.rewards import accuracy_reward


def test_procedures_by_hand():
    values = [3, 9, 2, 5]
    assert {name: apply_procedure(name, values) for name in PROCEDURES} == {
        "first": 3, "second": 9, "last": 5, "largest": 9, "smallest": 2}
    assert strategy_problem(values) == "Values: 3 9 2 5. Find the key value."
    assert problem_values(guided_problem(strategy_problem(values), ("SA", "DC"))) == values  # template before it
    assert [family_of(v) for v in ([1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6])] == [1, 2, 3]
    with pytest.raises(ValueError, match="no strategy_mix family lists 3 values"):
        family_of([1, 2, 3])
    with pytest.raises(ValueError, match="unknown procedure 'median'"):
        apply_procedure("median", values)
    with pytest.raises(ValueError, match="not a strategy_mix problem"):
        problem_values("What is 2 + 3?")


def test_generator_items():
    rows = make_items("strategy_mix", 3, seed=0)  # families cycle 1, 2, 3; fixed by the seed
    assert [(r["difficulty"], r["problem"], r["answer"]) for r in rows] == [
        (1, "Values: 2 1 8 7. Find the key value.", "8"),   # 4 values: the largest
        (2, "Values: 9 8 1 5 3. Find the key value.", "1"),  # 5 values: the smallest
        (3, "Values: 8 9 4 6 1 5. Find the key value.", "5"),  # 6 values: the last
    ]
    for row in make_items("strategy_mix", 300, seed=1, split="test"):
        values = problem_values(row["problem"])
        count, procedure = FAMILIES[row["difficulty"]]
        assert len(values) == count == condition_complexity(row["problem"]) and len(set(values)) == count
        assert set(values) <= set(range(1, 10)) and row["answer"] == str(apply_procedure(procedure, values))
        # only the family's procedure gives the answer: the first value (the weak start's default) never does
        assert [p for p in PROCEDURES if str(apply_procedure(p, values)) == row["answer"]] == [procedure]
    train = {r["problem"] for r in make_items("strategy_mix", 300, seed=0)}
    assert not train & {r["problem"] for r in make_items("strategy_mix", 300, seed=0, split="test")}


def test_reward_is_the_shared_accuracy():
    row = {"problem": "Values: 3 5 9 2. Find the key value.", "answer": "9"}
    texts = ["<answer>9</answer>", "<answer>3</answer>", "9", "<think>x</think><answer>9</answer>", "<answer></answer>"]
    assert accuracy_reward(texts, [row] * 5).tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert answer_text(7) == "<answer> 7</answer>"


class _Draws(random.Random):
    """random() returns the given draws in turn; choice() the last element."""

    def __init__(self, *draws: float):
        super().__init__(0)
        self.draws = list(draws)

    def random(self) -> float:
        return self.draws.pop(0)

    def choice(self, seq):
        return seq[-1]


def test_weak_start_procedure_by_hand():
    assert weak_start_procedure(("DC", "SA"), _Draws(0.99)) == "smallest"  # < follow 1 (default): the first action's
    assert weak_start_procedure(("DC", "SA"), _Draws(0.79), follow=0.8) == "smallest"
    assert weak_start_procedure(("DC", "SA"), _Draws(0.81), follow=0.8) == "first"
    assert weak_start_procedure(("OST",), _Draws(0.5), follow=0.4) == "first"
    assert weak_start_procedure(None, _Draws(0.14)) == "smallest"  # < explore 0.15: uniform (choice: last one)
    assert weak_start_procedure(None, _Draws(0.16)) == "first"
    assert weak_start_procedure((), _Draws(0.0), explore=0.0) == "first"
    assert ACTION_PROCEDURES == {"SA": "largest", "DC": "smallest", "OST": "last", "SRR": "second", "CoT": "first"}


def test_weak_start_data_frequencies():
    rng = random.Random(0)
    unguided = Counter(weak_start_procedure(None, rng) for _ in range(20_000))
    assert unguided["first"] / 20_000 == pytest.approx(0.85 + 0.15 / 5, abs=0.01)
    assert unguided["largest"] / 20_000 == pytest.approx(0.03, abs=0.005)
    guided = Counter(weak_start_procedure(("SA", "OST"), rng, follow=0.8) for _ in range(20_000))
    assert set(guided) == {"largest", "first"} and guided["largest"] / 20_000 == pytest.approx(0.8, abs=0.01)
    lengths = Counter()
    for _ in range(600):
        node = random_template(rng)
        lengths[len(node)] += 1
        assert all(a != b for a, b in zip(node, node[1:]))
    assert set(lengths) == {1, 2, 3}
    row, target = sft_example(random.Random(3))
    values = problem_values(row["problem"])
    assert len(values) in (4, 5, 6) and target in {answer_text(apply_procedure(p, values)) for p in PROCEDURES}


def test_search_and_retrieval_on_the_testbed():
    """A scorer that applies the first action's procedure exactly (follow = 1): the search finds each family's
    action, and retrieval by complexity (the count of values) returns it for new problems of that family."""
    def score(row, actions):
        return float(str(apply_procedure(ACTION_PROCEDURES[actions[0]], problem_values(row["problem"]))) == row["answer"])

    library = build_library(make_items("strategy_mix", 6, seed=0), score)
    assert [(t["complexity"], t["actions"], t["value"], t["count"]) for t in library["templates"]] == [
        (4, ["SA"], 1.0, 2), (5, ["DC"], 1.0, 2), (6, ["OST"], 1.0, 2)]
    for row in make_items("strategy_mix", 6, seed=0, split="test"):
        (actions,) = retrieve(library, row["problem"])
        assert actions == [{1: "SA", 2: "DC", 3: "OST"}[row["difficulty"]]]
