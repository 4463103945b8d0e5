"""The reward worker imports no torch (nor transformers) for the built-in rewards: they run as their
torch-free ``worker_form`` (a list of floats) and this process turns the results into tensors. A user
reward that imports torch still works: the worker imports it then."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mmpo.rewards import compute_rewards, get_reward
from mmpo.rewards.builtin import accuracy_values, format_values, length_values
from mmpo.rewards.registry import worker_form_of
from mmpo.rewards.worker import get_reward_worker, shutdown_reward_worker

PROBES = '''
import os
import sys


def torch_loaded(prompts, completions, **kwargs):
    return [float("torch" in sys.modules)] * len(completions)


def transformers_loaded(prompts, completions, **kwargs):
    return [float("transformers" in sys.modules)] * len(completions)


def worker_pid(prompts, completions, **kwargs):
    return [float(os.getpid())] * len(completions)
'''

USES_TORCH = '''
import torch


def quarter_steps(prompts, completions, **kwargs):
    return torch.arange(len(completions), dtype=torch.float32) / 4
'''

ROWS = [{"answer": "-26", "steps": ["67 - 20 = 47.", "47 - 73 = -26."], "images": []},
        {"answer": "-663", "steps": ["178 - 294 = -116.", "-116 - 547 = -663."], "images": []}] * 2
COMPLETIONS = [
    "<think>67 - 20 = 47. 47 - 73 = -26.</think><answer>-26</answer>",  # right, well-formed
    "<think>178 - 294 = -116</think><answer>-600</answer>",  # wrong, well-formed
    "so it is \\boxed{-26}",  # right, no think/answer blocks
    "<answer>-663</answer> <think>" + "a " * 18 + "b</think>",  # right, blocks in the wrong order, 20 words
]


def _vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM line")


@pytest.fixture
def fresh_worker():
    """The process-wide worker, stopped first: an earlier test's reward may have made it import torch."""
    shutdown_reward_worker()
    yield get_reward_worker()
    shutdown_reward_worker()


def test_builtins_run_as_their_worker_form_with_the_same_values():
    for name, values in (("accuracy", accuracy_values), ("format", format_values), ("length", length_values)):
        fn = get_reward(name)
        assert worker_form_of(fn) is values
        as_list = values(COMPLETIONS, ROWS)
        assert type(as_list) is list and all(type(v) is float for v in as_list)
        tensor = fn(COMPLETIONS, ROWS)
        assert tensor.dtype == torch.float32 and tensor.tolist() == as_list
    assert accuracy_values(COMPLETIONS, ROWS) == [1.0, 0.0, 1.0, 1.0]
    assert format_values(COMPLETIONS, ROWS) == [1.0, 1.0, 0.0, 0.0]
    # both references ("<think>67 - 20 = 47. 47 - 73 = -26.</think><answer>-26</answer>") have 10 words;
    # the completions 10, 5, 4 and 20: min(1, 10 / L)
    assert length_values(COMPLETIONS, ROWS) == [1.0, 1.0, 1.0, 0.5]
    a_function_of_its_own = lambda completions, rows: [0.0] * len(completions)  # noqa: E731
    assert worker_form_of(a_function_of_its_own) is a_function_of_its_own


@pytest.mark.timeout(120)
def test_the_worker_scores_accuracy_and_format_without_importing_torch(tmp_path, fresh_worker):
    probes = tmp_path / "probes.py"
    probes.write_text(PROBES)
    torch_probe, transformers_probe, pid_probe = (f"{probes}:{fn}" for fn in
                                                  ("torch_loaded", "transformers_loaded", "worker_pid"))
    restarts = fresh_worker.restarts  # the process-wide worker's count: earlier tests' deadline kills included
    total, per_fn, metrics = compute_rewards(
        {"accuracy": 0.9, "format": 0.1, torch_probe: 0.0, transformers_probe: 0.0, pid_probe: 0.0},
        COMPLETIONS, ROWS, timeout_s=60.0)
    assert per_fn[pid_probe].tolist() == [float(fresh_worker.pid)] * 4  # the probes ran in the worker
    assert fresh_worker.pid is not None and fresh_worker.restarts == restarts  # no kill, no restart here
    assert per_fn[torch_probe].tolist() == [0.0] * 4  # after accuracy and format ran there
    assert per_fn[transformers_probe].tolist() == [0.0] * 4
    assert per_fn["accuracy"].dtype == torch.float32 and per_fn["accuracy"].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert per_fn["format"].tolist() == [1.0, 1.0, 0.0, 0.0]
    # 0.9 * accuracy + 0.1 * format (the probes weigh 0)
    assert total.tolist() == pytest.approx([1.0, 0.1, 0.9, 0.9], abs=1e-7)
    assert metrics["rewards/accuracy/errors"] == 0.0 and metrics["rewards/format/errors"] == 0.0
    if sys.platform.startswith("linux"):  # torch alone is about 525 MiB of resident memory
        assert _vm_hwm_mib(fresh_worker.pid) < 300


@pytest.mark.timeout(120)
def test_a_user_reward_that_imports_torch_makes_the_worker_import_it(tmp_path, fresh_worker):
    probes, uses_torch = tmp_path / "probes.py", tmp_path / "uses_torch.py"
    probes.write_text(PROBES)
    uses_torch.write_text(USES_TORCH)
    torch_probe, pid_probe = f"{probes}:torch_loaded", f"{probes}:worker_pid"
    _, before, _ = compute_rewards({"format": 1.0, torch_probe: 0.0, pid_probe: 0.0}, COMPLETIONS, ROWS,
                                   timeout_s=60.0)
    assert before[torch_probe].tolist() == [0.0] * 4
    _, after, metrics = compute_rewards({f"{uses_torch}:quarter_steps": 1.0, torch_probe: 0.0, pid_probe: 0.0},
                                        COMPLETIONS, ROWS, timeout_s=60.0)
    assert after[f"{uses_torch}:quarter_steps"].tolist() == [0.0, 0.25, 0.5, 0.75]
    assert metrics["rewards/quarter_steps/errors"] == 0.0
    assert after[torch_probe].tolist() == [1.0] * 4
    assert after[pid_probe].tolist() == before[pid_probe].tolist() == [float(fresh_worker.pid)] * 4  # same worker
