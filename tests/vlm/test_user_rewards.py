"""Reward functions from the user's own code: ``file.py:fn`` / ``module:fn`` specs with TRL's
signature, None = not applicable, columns by name, validation before the model loads, and the
reward worker's deadline stopping a hung function loaded from a file."""

from __future__ import annotations

import logging
import math
import os
import pickle
import re
import sys
import threading
from pathlib import Path

import pytest

from mmpo.rewards import UserReward, compute_rewards, resolve_reward, validate_reward_weights
from mmpo.rewards.worker import get_reward_worker
from mmpo.training.config import RewardConfig

REPO = Path(__file__).resolve().parents[2]

USER_FILE = '''
import os
import time


def half_or_none(prompts, completions, **kwargs):
    """0.5 for completions that mention "yes", None (not applicable) for the others."""
    return [0.5 if "yes" in c else None for c in completions]


def exact_with_unit(prompts, completions, answer, unit):
    """No **kwargs: gets only the columns it names."""
    return [float(c == f"{a} {u}") for c, a, u in zip(completions, answer, unit)]


def prompt_length_and_columns(prompts, completions, **columns):
    return [len(p) + 100 * len(columns) for p in prompts]


def worker_pid(prompts, completions, **kwargs):
    return [float(os.getpid())] * len(completions)


def spins_forever(prompts, completions, **kwargs):
    while True:  # pure Python, holds no lock: only killing its process stops it
        pass


def as_tensor(prompts, completions, **kwargs):
    import torch
    return torch.arange(len(completions), dtype=torch.float64) / 2


def wrong_length(prompts, completions, **kwargs):
    return [1.0]


def nan_values(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)


def text_values(prompts, completions, **kwargs):
    return ["high"] * len(completions)


def needs_a_column(prompts, completions, solution_steps):
    return [0.0] * len(completions)


def positional_only(prompts, completions, /, **kwargs):
    return [0.0] * len(completions)


def no_prompts(completions, answer):
    return [0.0] * len(completions)


NOT_A_FUNCTION = 3
'''

ROWS = [
    {"problem": "2+1", "answer": "3", "unit": "cm"},
    {"problem": "10-8", "answer": "2", "unit": "m"},
    {"problem": "4/2", "answer": "2", "unit": "kg"},
]
COMPLETIONS = ["3 cm", "yes 2 m", "<answer>2</answer> yes"]


@pytest.fixture(scope="module")
def user_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user_rewards") / "my_rewards.py"
    path.write_text(USER_FILE)
    return path


def spec(path: Path, function: str) -> str:
    return f"{path}:{function}"


@pytest.mark.parametrize("timeout_s", [None, 60.0], ids=["inline", "worker"])
def test_none_is_skipped_in_the_weighted_sum(user_file, timeout_s):
    weights = {"accuracy": 2.0, spec(user_file, "half_or_none"): 4.0}
    total, per_fn, metrics = compute_rewards(weights, COMPLETIONS, ROWS, timeout_s=timeout_s)
    # accuracy: 0, 0, 1 (only the third has an answer tag); half_or_none: None, 0.5, 0.5
    # totals: 2*0 (None skipped) = 0 ; 2*0 + 4*0.5 = 2 ; 2*1 + 4*0.5 = 4
    assert total.tolist() == [0.0, 2.0, 4.0]
    values = per_fn[spec(user_file, "half_or_none")]
    assert math.isnan(values[0]) and values[1:].tolist() == [0.5, 0.5]
    assert metrics["rewards/half_or_none/mean"] == 0.5  # over the two completions it applies to
    assert metrics["rewards/half_or_none/none_frac"] == pytest.approx(1 / 3)
    assert metrics["rewards/half_or_none/errors"] == 0.0
    assert metrics["rewards/total/mean"] == pytest.approx(2.0)
    assert "rewards/accuracy/none_frac" not in metrics  # registered rewards never return None


def test_a_completion_every_function_skips_scores_zero_with_a_warning(user_file, caplog):
    with caplog.at_level(logging.WARNING):
        total, _, metrics = compute_rewards({spec(user_file, "half_or_none"): 1.0}, ["no", "nope"], ROWS[:2],
                                            timeout_s=None)
    assert total.tolist() == [0.0, 0.0]
    assert math.isnan(metrics["rewards/half_or_none/mean"]) and metrics["rewards/half_or_none/none_frac"] == 1.0
    assert "2 of 2 completions got None from every reward function" in caplog.text


def test_columns_are_passed_by_name(user_file):
    weights = {spec(user_file, "exact_with_unit"): 1.0, spec(user_file, "prompt_length_and_columns"): 1.0}
    _, per_fn, metrics = compute_rewards(weights, COMPLETIONS, ROWS, timeout_s=60.0)
    # exact_with_unit names answer and unit (and gets nothing else: no **kwargs, no TypeError)
    assert per_fn[spec(user_file, "exact_with_unit")].tolist() == [1.0, 0.0, 0.0]
    # **columns gets every field of the row: problem, answer, unit -> 300 + len(prompt)
    assert per_fn[spec(user_file, "prompt_length_and_columns")].tolist() == [303.0, 304.0, 303.0]
    assert metrics["rewards/exact_with_unit/errors"] == 0.0


def test_a_tensor_result_is_read_as_floats(user_file):
    total, _, _ = compute_rewards({spec(user_file, "as_tensor"): 2.0}, COMPLETIONS, ROWS, timeout_s=None)
    assert total.tolist() == [0.0, 1.0, 2.0]  # 2 x (0, 0.5, 1)


def test_a_file_function_runs_in_the_worker_process(user_file):
    _, per_fn, _ = compute_rewards({spec(user_file, "worker_pid"): 1.0}, COMPLETIONS, ROWS, timeout_s=60.0)
    pid = get_reward_worker().pid
    assert pid is not None and pid != os.getpid()
    assert per_fn[spec(user_file, "worker_pid")].tolist() == [float(pid)] * 3


def test_a_hung_function_from_a_file_is_stopped_by_the_deadline(user_file):
    compute_rewards({"format": 1.0}, COMPLETIONS, ROWS, timeout_s=60.0)  # the worker is up: its start is not timed
    worker = get_reward_worker()
    old_pid, restarts = worker.pid, worker.restarts
    threads_before = {t.name for t in threading.enumerate()}
    total, per_fn, metrics = compute_rewards({spec(user_file, "spins_forever"): 1.0, "format": 1.0},
                                             COMPLETIONS, ROWS, timeout_s=1.0)
    assert per_fn[spec(user_file, "spins_forever")].tolist() == [0.0, 0.0, 0.0]
    assert metrics["rewards/spins_forever/timeouts"] == 1.0 and metrics["rewards/spins_forever/errors"] == 1.0
    assert per_fn["format"].tolist() == [0.0, 0.0, 0.0]  # ran in a fresh worker after the kill
    assert worker.restarts == restarts + 1 and metrics["perf/reward_worker_restarts"] == restarts + 1
    with pytest.raises(ProcessLookupError):
        os.kill(old_pid, 0)  # killed and reaped, not left spinning
    # it ran in the worker, not on a thread of this process that nothing could stop
    assert {t.name for t in threading.enumerate()} - threads_before == set()
    # the next call of the same function is given its full deadline again, in a fresh worker
    _, _, metrics = compute_rewards({spec(user_file, "spins_forever"): 1.0}, COMPLETIONS[:1], ROWS[:1], timeout_s=1.0)
    assert metrics["rewards/spins_forever/timeouts"] == 1.0 and worker.restarts == restarts + 2


def test_a_slow_import_is_not_timed_by_the_call_deadline(tmp_path):
    path = tmp_path / "slow_import.py"
    path.write_text("import os, time\ntime.sleep(1.5)\n\n"  # 1 outside this test's process (in the worker)
                    f"def quick(prompts, completions, **kw):\n    return [float(os.getpid() != {os.getpid()})] * "
                    "len(completions)\n")
    worker = get_reward_worker()
    compute_rewards({"format": 1.0}, COMPLETIONS, ROWS, timeout_s=60.0)  # the worker is up
    restarts = worker.restarts
    total, _, metrics = compute_rewards({f"{path}:quick": 1.0}, COMPLETIONS, ROWS, timeout_s=1.0)
    # the worker spent 1.5 s loading the file, outside the 1 s deadline of the call itself
    assert total.tolist() == [1.0, 1.0, 1.0] and metrics["rewards/quick/timeouts"] == 0.0
    assert worker.restarts == restarts


@pytest.mark.parametrize(("function", "message"), [
    ("wrong_length", "returned 1 values for 3 completions"),
    ("text_values", "returned a str for completion 0"),
    ("needs_a_column", r"needs column\(s\) \['solution_steps'\] that the rows do not have"),
])
def test_malformed_results_are_counted_failures(user_file, function, message, caplog):
    with caplog.at_level(logging.WARNING):
        total, per_fn, metrics = compute_rewards({spec(user_file, function): 1.0, "accuracy": 1.0},
                                                 COMPLETIONS, ROWS, timeout_s=60.0)
    assert per_fn[spec(user_file, function)].tolist() == [0.0, 0.0, 0.0]
    assert total.tolist() == [0.0, 0.0, 1.0]  # accuracy still counts
    assert metrics[f"rewards/{function}/errors"] == 1.0
    assert re.search(message, caplog.text)


def test_non_finite_values_are_rejected_and_counted_not_a_failure(user_file, caplog):
    # nan_values returns NaN for every completion: each is rejected (no reward from it, like None), the
    # call is no error, and accuracy still counts
    with caplog.at_level(logging.WARNING):
        total, per_fn, metrics = compute_rewards({spec(user_file, "nan_values"): 1.0, "accuracy": 1.0},
                                                 COMPLETIONS, ROWS, timeout_s=60.0)
    assert all(math.isnan(v) for v in per_fn[spec(user_file, "nan_values")].tolist())
    assert total.tolist() == [0.0, 0.0, 1.0]
    assert metrics["rewards/nan_values/nonfinite"] == 3.0 and metrics["rewards/nan_values/errors"] == 0.0
    assert "returned 3 non-finite value(s) of 3: rejected" in caplog.text


def test_module_spec_is_imported_from_sys_path(tmp_path, monkeypatch):
    (tmp_path / "mmpo_test_user_reward_pkg").mkdir()
    (tmp_path / "mmpo_test_user_reward_pkg" / "__init__.py").write_text("")
    (tmp_path / "mmpo_test_user_reward_pkg" / "scoring.py").write_text(
        "def long_answers(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    name = "mmpo_test_user_reward_pkg.scoring:long_answers"
    total, _, metrics = compute_rewards({name: 0.5}, COMPLETIONS, ROWS, timeout_s=60.0)
    assert total.tolist() == [2.0, 3.5, 11.0]  # 0.5 x len: 4, 7, 22
    assert metrics["rewards/long_answers/errors"] == 0.0


def test_relative_paths_are_read_from_the_working_directory(user_file, monkeypatch):
    monkeypatch.chdir(user_file.parent)
    reward = resolve_reward("my_rewards.py:exact_with_unit")
    assert reward is resolve_reward(spec(user_file, "exact_with_unit"))  # one object per function
    assert isinstance(reward, UserReward)
    assert pickle.loads(pickle.dumps(reward)) is reward  # pickles as its absolute spec


@pytest.mark.parametrize(("weights", "message"), [
    ({"acuracy": 1.0}, r"reward_weights: unknown reward 'acuracy'; registered: \[.*'accuracy'.*'format'"),
    ({"missing_file.py:fn": 1.0}, r"reward 'missing_file.py:fn': file '.*missing_file.py' not found"),
    ({"{file}:no_such_function": 1.0}, r"my_rewards.py has no 'no_such_function'; functions defined there: "
                                       r"\[.*'half_or_none'"),
    ({"{file}:NOT_A_FUNCTION": 1.0}, "'NOT_A_FUNCTION' is a int, not a function"),
    ({"{file}:positional_only": 1.0}, r"bad signature positional_only\(prompts, completions, /, \*\*kwargs\): "
                                      r"it has positional-only parameter"),
    ({"{file}:no_prompts": 1.0}, r"bad signature no_prompts\(completions, answer\): it does not accept prompts "
                                 r"by keyword; expected TRL's fn\(prompts, completions, \*\*columns\)"),
    ({"{broken}:fn": 1.0}, r"loading '.*broken.py' failed: SyntaxError"),
    ({"no_such_package_xyz.mod:fn": 1.0}, "no module 'no_such_package_xyz'"),
    ({"{file}:half_or_none": 1.0, "{other}:half_or_none": 1.0}, "would both log as rewards/half_or_none/"),
    ({"{file}:half_or_none": float("inf")}, "the weight of '.*half_or_none' must be a finite number"),
])
def test_bad_reward_settings_name_the_function_and_the_problem(user_file, tmp_path, weights, message):
    (tmp_path / "broken.py").write_text("def fn(prompts, completions, **kw)\n    return []\n")
    (tmp_path / "other.py").write_text(USER_FILE)
    paths = {"file": user_file, "broken": tmp_path / "broken.py", "other": tmp_path / "other.py"}
    weights = {key.format(**paths): value for key, value in weights.items()}
    with pytest.raises(ValueError, match=message):  # RewardSpecError is a ValueError, as the CLI expects
        validate_reward_weights(weights)


def test_grpo_refuses_a_bad_reward_before_loading_the_model(user_file, monkeypatch):
    import mmpo.algos.grpo as grpo
    import mmpo.algos.vlm_base as vlm_base

    def must_not_load(*args, **kwargs):
        raise AssertionError("load_vlm was called before the reward settings were checked")

    monkeypatch.setattr(vlm_base, "load_vlm", must_not_load)  # the shared VLM base loads the model
    with pytest.raises(ValueError, match=r"reward_weights: reward '.*my_rewards.py:no_prompts': bad signature"):
        grpo.GRPOModule("no/model/here", rewards=RewardConfig(weights={spec(user_file, "no_prompts"): 1.0}))
    with pytest.raises(ValueError, match="unknown reward 'acuracy'; registered:"):
        grpo.GRPOModule("no/model/here", rewards=RewardConfig(weights={"acuracy": 1.0}))


def test_the_cli_refuses_a_bad_reward_path_before_loading_the_model(monkeypatch, capsys, tmp_path):
    import mmpo.algos.vlm_base as vlm_base
    from mmpo.cli import main

    calls = []
    monkeypatch.setattr(vlm_base, "load_vlm", lambda *a, **k: calls.append(a) or sys.exit("model loaded"))
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(REPO / "configs/vlm/grpo_tiny_user_reward.yaml"),
              f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false",
              '--model.init_args.rewards.weights={"examples/rewardz.py:answer_mentioned": 1.0}'])
    assert exit_info.value.code == 2 and calls == []
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("mmpo fit: error: model (mmpo.algos.grpo.GRPOModule): reward_weights: "
                           "reward 'examples/rewardz.py:answer_mentioned': file ")
    assert "rewardz.py' not found" in last


def test_the_example_rewards_follow_their_docstrings():
    rows = [{"problem": "q", "answer": "7", "difficulty": 1}, {"problem": "q", "answer": "7", "difficulty": 2},
            {"problem": "q", "answer": "7", "difficulty": 1}, {"problem": "q", "answer": "-2.5", "difficulty": 3}]
    completions = ["The answer is 7.", "<think>so</think><answer>7</answer>", "about 17 really", "x=-2.5, done"]
    mentioned = resolve_reward(str(REPO / "examples/rewards.py:answer_mentioned"))
    brevity = resolve_reward(str(REPO / "examples/rewards.py:brevity_when_easy"))
    assert mentioned(completions, rows) == [1.0, 1.0, 0.0, 1.0]  # 17 is not 7
    assert brevity(completions, rows) == [1 / 5, None, 1 / 4, None]  # 4 words, n/a, 3 words, n/a
