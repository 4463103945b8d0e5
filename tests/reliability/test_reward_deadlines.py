"""A model answer can never hang a run: rewards run in a worker process that a deadline kills,
answer extraction is linear, and log lines never quote a whole pathological answer."""

from __future__ import annotations

import importlib
import logging
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from mmpo.rewards import REWARDS, compute_rewards, extract_answer
from mmpo.rewards.answers import MAX_ANSWER_CHARS, answers_match, last_boxed, tag_blocks
from mmpo.rewards.builtin import is_think_answer_format
from mmpo.rewards.gcpo import detect_auxiliary_tag
from mmpo.rewards.log_text import MAX_LOGGED_CHARS, shorten
from mmpo.rewards.step import is_valid_step_format, step_sections_text
from mmpo.rewards.worker import get_reward_worker, shutdown_reward_worker

TOWER = "<answer>10^{10^{10^{10}}}</answer>"
ROWS = [{"answer": "3", "steps": [], "images": []}, {"answer": "left", "steps": [], "images": []}]
COMPLETIONS = ["<think>x</think><answer>3</answer>", "the answer is \\boxed{right}"]

PLUGIN = '''
import time

import torch

from mmpo.rewards import register_reward


@register_reward("test_sleeps_forever")
def sleeps_forever(completions, rows):
    while True:
        time.sleep(1)


@register_reward("test_raises_with_the_completion")
def raises_with_the_completion(completions, rows):
    raise ValueError("cannot score " + completions[0])


@register_reward("test_exits_the_worker")
def exits_the_worker(completions, rows):
    import os
    os._exit(3)
'''


def _alive(pid: int) -> bool:
    """Running (a zombie left for a container's init to reap counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: trust kill(0)
        return True


@pytest.fixture(scope="module")
def plugin_rewards(tmp_path_factory):
    """A user's reward module, importable by the worker through ``sys.path`` (as a user's would be)."""
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "mmpo_test_reward_plugin.py").write_text(PLUGIN)
    sys.path.insert(0, str(folder))
    importlib.import_module("mmpo_test_reward_plugin")
    yield
    for name in ("test_sleeps_forever", "test_raises_with_the_completion", "test_exits_the_worker"):
        REWARDS.pop(name, None)
    sys.modules.pop("mmpo_test_reward_plugin", None)
    sys.path.remove(str(folder))


@pytest.fixture
def warm_worker():
    """A started worker, so that timings below measure calls, not the worker's imports."""
    compute_rewards({"format": 1.0}, COMPLETIONS, ROWS, timeout_s=60.0)
    return get_reward_worker()


@pytest.mark.timeout(60)
def test_the_issue_call_returns_with_zero_reward(warm_worker):
    start = time.monotonic()
    total, per_fn, metrics = compute_rewards({"accuracy": 1.0}, [TOWER], [{"answer": "3"}], timeout_s=5.0)
    assert time.monotonic() - start < 5.0 + 5.0
    assert total.tolist() == [0.0] and per_fn["accuracy"].tolist() == [0.0]
    # The worker's deadline (5 s) and math-verify's own (5 s) race here; either gives 0. With a
    # shorter deadline the worker is killed for sure, and counted:
    restarts = warm_worker.restarts
    total, _, metrics = compute_rewards({"accuracy": 1.0}, [TOWER], [{"answer": "3"}], timeout_s=1.0)
    assert total.tolist() == [0.0]
    assert metrics["rewards/accuracy/errors"] == 1.0 and metrics["rewards/accuracy/timeouts"] == 1.0
    assert metrics["perf/reward_worker_restarts"] == restarts + 1


@pytest.mark.timeout(60)
def test_math_verify_timeout_is_live_in_the_worker_and_spares_the_batch(warm_worker):
    # math-verify's signal timeout works on the worker's main thread: the tower scores 0 after
    # MATH_VERIFY_TIMEOUT_S and the other completion of the batch is still scored.
    _, per_fn, metrics = compute_rewards({"accuracy": 1.0}, [TOWER, "<answer>3</answer>"],
                                         [{"answer": "3"}, {"answer": "3"}], timeout_s=45.0)
    assert per_fn["accuracy"].tolist() == [0.0, 1.0]
    assert metrics["rewards/accuracy/errors"] == 0.0 and metrics["rewards/accuracy/timeouts"] == 0.0


@pytest.mark.timeout(90)
def test_a_user_reward_that_never_returns_is_killed_and_the_next_call_gets_a_fresh_worker(
        plugin_rewards, warm_worker, caplog):
    old_pid, restarts = warm_worker.pid, warm_worker.restarts
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        # The call after the stuck one in the same batch runs in the fresh worker.
        total, per_fn, metrics = compute_rewards({"test_sleeps_forever": 1.0, "format": 1.0}, COMPLETIONS, ROWS,
                                                 timeout_s=1.0)
    assert time.monotonic() - start < 60.0  # 1 s deadline + the fresh worker's start-up
    assert per_fn["test_sleeps_forever"].tolist() == [0.0, 0.0]
    assert per_fn["format"].tolist() == [1.0, 0.0] and total.tolist() == [1.0, 0.0]
    assert metrics["rewards/test_sleeps_forever/errors"] == 1.0
    assert metrics["rewards/test_sleeps_forever/timeouts"] == 1.0
    assert metrics["rewards/format/errors"] == 0.0 and metrics["rewards/format/timeouts"] == 0.0
    assert metrics["perf/reward_worker_restarts"] == restarts + 1
    assert not _alive(old_pid)  # killed and reaped
    assert any("did not finish within 1.0 s" in r.getMessage() for r in caplog.records)
    new_pid = warm_worker.pid
    assert new_pid is not None and new_pid != old_pid
    # Later calls work normally in the new worker.
    _, per_fn, metrics = compute_rewards(None, COMPLETIONS, ROWS, timeout_s=30.0)
    assert per_fn["accuracy"].tolist() == [1.0, 0.0] and metrics["rewards/accuracy/errors"] == 0.0
    assert warm_worker.pid == new_pid and metrics["perf/reward_worker_restarts"] == restarts + 1


@pytest.mark.timeout(90)
def test_raising_and_crashing_rewards_give_zeros_an_error_and_a_short_log_line(plugin_rewards, warm_worker, caplog):
    long_completion = "<answer>" + "7" * 50_000 + "</answer>"
    with caplog.at_level(logging.WARNING):
        total, per_fn, metrics = compute_rewards(
            {"test_raises_with_the_completion": 1.0, "accuracy": 1.0}, [long_completion], [{"answer": "7"}],
            timeout_s=30.0)
    assert per_fn["test_raises_with_the_completion"].tolist() == [0.0]
    assert per_fn["accuracy"].tolist() == [0.0]  # over MAX_ANSWER_CHARS: not parsed, wrong
    assert metrics["rewards/test_raises_with_the_completion/errors"] == 1.0
    assert metrics["rewards/test_raises_with_the_completion/timeouts"] == 0.0
    failure = [r.getMessage() for r in caplog.records if "test_raises_with_the_completion" in r.getMessage()]
    assert len(failure) == 1 and "ValueError: cannot score <answer>777" in failure[0]
    assert len(failure[0]) < 2 * MAX_LOGGED_CHARS and failure[0].endswith("chars)")
    # A reward that kills its own process: counted, and the worker is replaced.
    restarts = warm_worker.restarts
    _, per_fn, metrics = compute_rewards({"test_exits_the_worker": 1.0, "format": 1.0}, COMPLETIONS, ROWS,
                                         timeout_s=30.0)
    assert per_fn["test_exits_the_worker"].tolist() == [0.0, 0.0] and per_fn["format"].tolist() == [1.0, 0.0]
    assert metrics["rewards/test_exits_the_worker/errors"] == 1.0
    assert metrics["perf/reward_worker_restarts"] == restarts + 1


def test_worker_and_inline_results_are_identical(warm_worker):
    completions = COMPLETIONS + ["<answer>\\sqrt{12}</answer>", "### The final answer is: (B)", "<answer>1/2</answer>"]
    rows = ROWS + [{"answer": "2\\sqrt{3}"}, {"answer": "b"}, {"answer": "0.5"}]
    rows = [{"steps": [], "images": [], **row} for row in rows]
    total, per_fn, metrics = compute_rewards(None, completions, rows, timeout_s=30.0)
    inline_total, inline_per_fn, _ = compute_rewards(None, completions, rows, timeout_s=None)
    assert per_fn["accuracy"].tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]
    assert per_fn["format"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert torch.equal(total, inline_total) and torch.equal(per_fn["accuracy"], inline_per_fn["accuracy"])
    assert metrics["rewards/accuracy/errors"] == 0.0 and metrics["rewards/format/timeouts"] == 0.0


def test_closures_run_in_the_caller_with_a_warning(caplog):
    name = "test_closure_reward"
    offset = 0.25
    REWARDS[name] = lambda completions, rows: torch.full((len(completions),), offset)
    try:
        with caplog.at_level(logging.WARNING):
            total, _, metrics = compute_rewards({name: 2.0}, COMPLETIONS, ROWS, timeout_s=10.0)
        assert total.tolist() == [0.5, 0.5] and metrics[f"rewards/{name}/errors"] == 0.0
        assert any("deadline cannot stop a hang" in r.getMessage() for r in caplog.records)
    finally:
        REWARDS.pop(name)


def test_shutdown_leaves_no_worker_process_and_a_later_call_starts_one(warm_worker):
    pid = warm_worker.pid
    assert _alive(pid)
    shutdown_reward_worker()
    assert warm_worker.pid is None and not _alive(pid)
    _, per_fn, _ = compute_rewards({"format": 1.0}, COMPLETIONS, ROWS, timeout_s=60.0)
    assert per_fn["format"].tolist() == [1.0, 0.0] and warm_worker.pid not in (None, pid)


def _run_python(code: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, env=env)


@pytest.mark.timeout(120)
def test_interpreter_exit_stops_the_worker():
    trainer = _run_python("""
        from mmpo.rewards import compute_rewards
        from mmpo.rewards.worker import get_reward_worker
        compute_rewards(None, ["<answer>3</answer>"], [{"answer": "3"}], timeout_s=60.0)
        print(get_reward_worker().pid, flush=True)
    """)
    worker_pid = int(trainer.stdout.readline())
    assert trainer.wait(60) == 0  # no hang at exit
    assert not _alive(worker_pid)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux-only")
def test_a_trainer_killed_with_sigkill_takes_a_stuck_worker_with_it(plugin_rewards):
    trainer = _run_python("""
        import mmpo_test_reward_plugin
        from mmpo.rewards import compute_rewards
        from mmpo.rewards.worker import get_reward_worker
        compute_rewards({"format": 1.0}, ["x"], [{"answer": "3"}], timeout_s=60.0)
        print(get_reward_worker().pid, flush=True)
        compute_rewards({"test_sleeps_forever": 1.0}, ["x"], [{"answer": "3"}], timeout_s=600.0)
    """)
    worker_pid = int(trainer.stdout.readline())
    time.sleep(1.0)  # the worker is now inside sleeps_forever
    trainer.send_signal(signal.SIGKILL)
    trainer.wait(10)
    deadline = time.monotonic() + 10
    while _alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker_pid)


# ---------------------------------------------------------------- linear answer extraction

N = 200_000  # characters: seconds for the linear scans below, hours for the old quadratic ones


@pytest.mark.timeout(10)
def test_pathological_boxed_and_tag_inputs_extract_in_linear_time():
    assert last_boxed("\\boxed{" * 20_000) is None
    assert last_boxed("\\boxed{" * 20_000 + "7}") == "7"
    assert extract_answer("\\boxed{" * 20_000) is None
    assert extract_answer("<answer>" * (N // 8)) is None
    assert extract_answer("<answer>" * (N // 8) + "5</answer>") == "<answer>" * (N // 8 - 1) + "5"
    assert extract_answer("<answer>1</answer>" + "<answer>" * (N // 8)) == "1"
    assert not is_think_answer_format("<think>" + "</think><answer>" * (N // 16))
    assert not is_think_answer_format("<think>x</think><answer>" + "</answer> x" * (N // 10))
    assert detect_auxiliary_tag("<auxiliary>" * (N // 11)) is False
    assert detect_auxiliary_tag("<auxiliary>" * (N // 11) + "x</auxiliary>") is True
    assert step_sections_text("### Step 1:" + "\n" * N) == ""
    assert step_sections_text("### Step 1: A\n" + " \n" * N + "### Step 2: B") == "a\nb"


def test_extraction_results_for_normal_inputs():
    assert last_boxed("a \\boxed{1} b \\fbox{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{2} \\boxed{3") == "2"  # the last one is unclosed
    assert extract_answer("<answer>a</answer> <answer> \\boxed{4} </answer>") == "4"
    assert is_think_answer_format(" <think>a</think>\n<answer>b</answer>\n")
    assert not is_think_answer_format("<think>a</think> x <answer>b</answer>")
    assert not is_think_answer_format("<think>a</think><answer> </answer>")
    text = "### Step 1: Add\n\n  ### Step 2: Sum ### not a header\n### The final answer is: 3"
    assert step_sections_text(text) == "add\nsum ### not a header"


def test_answers_over_the_cap_are_wrong_and_huge_step_numbers_do_not_raise():
    assert answers_match("3", "3") and not answers_match("3" * (MAX_ANSWER_CHARS + 1), "3" * (MAX_ANSWER_CHARS + 1))
    headers = "### Image Description: x\n### Rationales: y\n### Step 1: a\n"
    assert not is_valid_step_format(headers + "### Step " + "2" * 5000 + ": b\n### The final answer is: 3")
    assert is_valid_step_format(headers + "### Step 2: b\n### The final answer is: 3")


def test_shorten():
    assert shorten("abc") == "abc"
    assert shorten("x" * 500) == "x" * MAX_LOGGED_CHARS + "... (500 chars)"


def _quadratic_last_boxed(text: str) -> str | None:
    # The former implementation: a forward scan from every \boxed{, last first.
    for match in reversed(list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))):
        depth = 1
        for pos in range(match.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[pos], 0)
            if depth == 0:
                return text[match.end():pos]
    return None


_FORMAT_REGEX = re.compile(r"^\s*<think>(?P<think>.*?)</think>\s*<answer>(?P<answer>.*?)</answer>\s*$", re.DOTALL)
_STEP_SECTION_REGEX = re.compile(r"### Step \d+:(.*?)(?=\n\s*###|\Z)", re.DOTALL)
_PIECES = ["<think>", "</think>", "<answer>", "</answer>", "<auxiliary>", "</auxiliary>", "\\boxed{", "\\fbox {",
           "{", "}", "### Step 1:", "### Step 2:", "###", "\n", " ", "x", "7"]


def test_linear_scans_agree_with_the_former_regexes_on_random_texts():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 14)))
        assert last_boxed(text) == _quadratic_last_boxed(text), text
        assert list(tag_blocks(text, "<answer>", "</answer>")) == re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
        match = _FORMAT_REGEX.match(text)
        expected_format = match is not None and bool(match.group("answer").strip()) and not any(
            tag in match.group("think") + match.group("answer") for tag in ("<think>", "</think>", "<answer>", "</answer>"))
        assert is_think_answer_format(text) == expected_format, text
        expected_steps = "\n".join(body.strip() for body in _STEP_SECTION_REGEX.findall(text)).lower()
        assert step_sections_text(text) == expected_steps, text


def test_math_verify_log_lines_are_cut(caplog):
    with caplog.at_level(logging.WARNING, logger="math_verify.parser"):
        logging.getLogger("math_verify.parser").warning("Timeout during parsing: %s", "9" * 50_000)
    (record,) = [r for r in caplog.records if r.name == "math_verify.parser"]
    assert record.getMessage() == shorten("Timeout during parsing: " + "9" * 50_000)
    assert record.getMessage().endswith("... (50024 chars)")


def test_start_runs_the_worker_before_any_call_and_is_idempotent(warm_worker):
    shutdown_reward_worker()
    assert warm_worker.pid is None
    warm_worker.start()  # what GRPOModule.on_fit_start does: the start-up is paid before step 1
    pid = warm_worker.pid
    assert _alive(pid)
    warm_worker.start()
    assert warm_worker.pid == pid  # a live worker is kept
    _, per_fn, _ = compute_rewards({"format": 1.0}, COMPLETIONS, ROWS, timeout_s=60.0)
    assert per_fn["format"].tolist() == [1.0, 0.0] and warm_worker.pid == pid
