"""avg@k / pass@k with hand-computed values (pass@k: arXiv 2107.03374, eq. 1)."""

from math import comb

import pytest

from mmpo.eval.metrics import pass_at_k, pass_at_k_budgets, summarize_correctness


def test_pass_at_k_hand_computed():
    # n=5, c=2, k=1: c/n = 2/5
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=10, c=3, k=5: 1 - C(7,5)/C(10,5) = 1 - 21/252 = 0.916666...
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)
    # no correct sample -> 0; fewer wrong samples than k -> 1
    assert pass_at_k(4, 0, 3) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 1, 4) == 1.0


def test_pass_at_k_matches_binomial_definition():
    # the running product equals 1 - C(n-c,k)/C(n,k) everywhere on a grid
    for n in range(1, 12):
        for c in range(0, n + 1):
            for k in range(1, n + 1):
                expected = 1.0 - comb(n - c, k) / comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_finite():
    # C(1000, 500) overflows a float; the product form does not
    assert pass_at_k(1000, 10, 500) == pytest.approx(1 - comb(990, 500) / comb(1000, 500))


@pytest.mark.parametrize("n, c, k", [(4, 1, 0), (4, 1, 5), (4, 5, 1), (4, -1, 1)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_budgets():
    assert pass_at_k_budgets(1) == [1]
    assert pass_at_k_budgets(4) == [1, 2, 4]
    assert pass_at_k_budgets(6) == [1, 2, 4, 6]


def test_summarize_correctness_hand_computed():
    correct = [[True, False, False, False], [True, True, False, False]]
    metrics = summarize_correctness(correct)
    assert metrics["num_items"] == 2 and metrics["num_samples"] == 4
    # 3 correct of 8 samples
    assert metrics["accuracy"] == pytest.approx(3 / 8)
    assert metrics["avg@4"] == pytest.approx(3 / 8)
    # pass@1 = mean(c/n) = (1/4 + 2/4) / 2
    assert metrics["pass@1"] == pytest.approx(0.375)
    # pass@2: item 1: 1 - C(3,2)/C(4,2) = 1/2; item 2: 1 - C(2,2)/C(4,2) = 5/6
    assert metrics["pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    # pass@4: both items have a correct sample
    assert metrics["pass@4"] == pytest.approx(1.0)


def test_summarize_greedy_is_plain_accuracy():
    metrics = summarize_correctness([[True], [False], [True], [True]])
    assert metrics["accuracy"] == pytest.approx(0.75)
    assert metrics["pass@1"] == pytest.approx(0.75)
    assert set(metrics) == {"num_items", "num_samples", "accuracy", "avg@1", "pass@1"}


def test_summarize_rejects_empty():
    with pytest.raises(ValueError, match="non-empty"):
        summarize_correctness([])
