"""Runs that survive a cluster (issue 37, items 1-3), black-box through ``mmpo fit`` in a subprocess.

- SIGTERM mid-run: exit 143, ``last.ckpt`` of the last completed step verifies with ``sha256sum -c``, and the
  resumed run ends with exactly the weights and optimizer state of an uninterrupted run; a second SIGTERM
  during that save changes nothing.
- A kill right after ``last.ckpt`` is replaced, before its sidecar: resuming from ``last.ckpt`` falls back to
  ``last.prev.ckpt`` with one line, and the leftover temporary is removed.
- A full disk (the kernel's ENOSPC, from ``/dev/full``) at a checkpoint save: one line naming the file, exit 28,
  the previous checkpoint kept; the resume finishes the run.

The faults come from tests/reliability/fault_runner.py. 4 SFT steps of the tiny VLM config (batch 2).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmpo.cli import DISK_FULL_EXIT_CODE, main
from mmpo.training.checkpoint import checksum_status, previous_path, sidecar_path
from tiny_vlm_support import build_small_vlm

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("fault_runner.py")
MAX_STEPS = 4


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> str:
    return build_small_vlm(tmp_path_factory.mktemp("tiny"))


def _sft_args(model: str, root: Path, *extra: str, every_n_steps: int = MAX_STEPS) -> list[str]:
    return [
        "fit", "-c", str(REPO / "configs/vlm/sft_tiny.yaml"), f"--model.init_args.model_path={model}",
        f"--model.init_args.output_dir={root / 'hf'}", f"--trainer.max_steps={MAX_STEPS}",
        f"--trainer.default_root_dir={root}", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--trainer.limit_val_batches=0",
        f"--trainer.callbacks.init_args.dirpath={root / 'ckpt'}",
        f"--trainer.callbacks.init_args.every_n_train_steps={every_n_steps}",
        "--data.init_args.train_size=16", "--data.init_args.batch_size=2", *extra,
    ]


def _start(args: list[str], fault: dict) -> subprocess.Popen:
    env = {**os.environ, "MMPO_TEST_FAULT": json.dumps(fault), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(RUNNER), *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_file(path: Path, process: subprocess.Popen, seconds: float = 240.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"the run ended ({process.returncode}) before {path.name}:\n"
                                 f"{process.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"no {path.name} after {seconds} s"
        time.sleep(0.02)


def _state(path: Path) -> dict:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    return {key: checkpoint[key] for key in ("state_dict", "optimizer_states", "global_step")}


def _assert_same(expected, actual, where: str = "checkpoint") -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(expected, actual), f"{where} differs"
    elif isinstance(expected, dict):
        assert expected.keys() == actual.keys(), where
        for key in expected:
            _assert_same(expected[key], actual[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), where
        for index, (e, a) in enumerate(zip(expected, actual)):
            _assert_same(e, a, f"{where}[{index}]")
    else:
        assert expected == actual, f"{where}: {expected!r} != {actual!r}"


def _sha256sum_check(directory: Path, *names: str) -> None:
    result = subprocess.run(["sha256sum", "-c", *(n + ".sha256" for n in names)], cwd=directory,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def uninterrupted(tiny_vlm, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("uninterrupted")
    assert main(_sft_args(tiny_vlm, root)) == 0
    return _state(root / "ckpt" / "last.ckpt")


@pytest.mark.slow
@pytest.mark.parametrize("second_signal", [False, True])
def test_sigterm_saves_last_and_exits_143_and_the_resume_equals_an_uninterrupted_run(
        tiny_vlm, uninterrupted, tmp_path, second_signal):
    marker, paused, resume = tmp_path / "at_step", tmp_path / "paused", tmp_path / "resume"
    fault = ({"kind": "pause_last_save", "step": 2, "marker": str(marker), "paused": str(paused), "resume": str(resume)}
             if second_signal else {"kind": "wait_for_signal", "step": 2, "marker": str(marker)})
    process = _start(_sft_args(tiny_vlm, tmp_path), fault)
    _wait_for_file(marker, process)
    process.send_signal(signal.SIGTERM)
    if second_signal:  # a second SIGTERM while last.ckpt is being written
        _wait_for_file(paused, process)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        resume.write_text("go")
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == 143, stderr[-3000:]
    assert "received SIGTERM: stopping after the current step" in stderr

    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["last.ckpt", "last.ckpt.sha256"]  # no temporaries, no lock
    _sha256sum_check(ckpt, "last.ckpt")
    assert torch.load(ckpt / "last.ckpt", weights_only=True)["global_step"] == 2  # the last completed step

    assert main(_sft_args(tiny_vlm, tmp_path, f"--ckpt_path={ckpt / 'last.ckpt'}")) == 0
    _assert_same(uninterrupted, _state(ckpt / "last.ckpt"))


@pytest.mark.slow
def test_sigusr1_also_saves_and_exits_138(tiny_vlm, tmp_path):
    marker = tmp_path / "at_step"
    process = _start(_sft_args(tiny_vlm, tmp_path), {"kind": "wait_for_signal", "step": 1, "marker": str(marker)})
    _wait_for_file(marker, process)
    process.send_signal(signal.SIGUSR1)
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == 138, stderr[-3000:]
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("kill_after", ["new_last_ckpt", "prev_link"])
def test_a_kill_between_the_renames_of_a_last_save_leaves_a_verifiable_checkpoint(
        tiny_vlm, uninterrupted, tmp_path, capsys, kill_after):
    """Every step saves last.ckpt (and nothing else); the step-3 save is killed (os._exit, no clean-up)

    - new_last_ckpt: right after the new file replaced last.ckpt, before its sidecar: last.ckpt (step 3) no
      longer matches its sidecar; last.prev.ckpt (step 2) verifies, and the resume falls back to it in one line;
    - prev_link: right after last.ckpt (step 2) got its second name last.prev.ckpt, before that one's sidecar:
      last.ckpt still verifies, and the step-3 temporary left behind is removed when the resumed run starts.
    """
    name, nth = ("last.ckpt", 3) if kill_after == "new_last_ckpt" else ("last.prev.ckpt", 2)
    only_last = "--trainer.callbacks.init_args.save_top_k=0"  # the .prev file is the only fallback
    process = _start(_sft_args(tiny_vlm, tmp_path, only_last, every_n_steps=1),
                     {"kind": "exit_after_replace", "name": name, "nth": nth})
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == 137, stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    last = ckpt / "last.ckpt"
    temporaries = sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".tmp"))
    if kill_after == "new_last_ckpt":
        assert torch.load(last, weights_only=True)["global_step"] == 3 and checksum_status(last) == "mismatch"
        _sha256sum_check(ckpt, "last.prev.ckpt")
        assert torch.load(previous_path(last), weights_only=True)["global_step"] == 2
        assert temporaries == []
        expected_lines = [f"mmpo fit: checkpoint {last} cannot be used (its sha256 does not match last.ckpt.sha256 "
                          "(bytes changed after it was written)); resuming from the newest verifiable checkpoint "
                          f"beside it, {previous_path(last)}"]
    else:
        _sha256sum_check(ckpt, "last.ckpt")
        assert torch.load(last, weights_only=True)["global_step"] == 2
        assert temporaries == [f".last.ckpt.{process.pid}.tmp"]  # the step-3 bytes, never renamed into place
        expected_lines = []

    # the keyword "last" (Lightning's lookup) takes the same fallback as the explicit path
    resume_from = "last" if kill_after == "new_last_ckpt" else str(last)
    assert main(_sft_args(tiny_vlm, tmp_path, only_last, f"--ckpt_path={resume_from}", every_n_steps=1)) == 0
    assert [line for line in capsys.readouterr().err.splitlines() if "cannot be used" in line] == expected_lines
    assert not [p for p in ckpt.iterdir() if p.name.endswith(".tmp")], "stale temporaries were not removed"
    _sha256sum_check(ckpt, "last.ckpt", "last.prev.ckpt")
    _assert_same(uninterrupted, _state(last))


@pytest.mark.slow
def test_full_disk_at_a_save_is_one_line_and_the_resume_finishes(tiny_vlm, uninterrupted, tmp_path):
    # saves every step: last.ckpt and the top-1 file; the 5th checkpoint written (step 3's first) hits ENOSPC
    process = _start(_sft_args(tiny_vlm, tmp_path, every_n_steps=1), {"kind": "enospc_at_save", "nth": 5})
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == DISK_FULL_EXIT_CODE, stderr[-3000:]
    last_line = stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"mmpo fit: error: disk full: no space left to write {tmp_path / 'ckpt'}/")
    assert "unexpected pos" not in stderr and "Traceback" not in stderr
    ckpt = tmp_path / "ckpt"
    assert torch.load(ckpt / "last.ckpt", weights_only=True)["global_step"] == 2  # the previous good one, kept
    _sha256sum_check(ckpt, "last.ckpt")

    assert main(_sft_args(tiny_vlm, tmp_path, f"--ckpt_path={ckpt / 'last.ckpt'}", every_n_steps=1)) == 0
    _assert_same(uninterrupted, _state(ckpt / "last.ckpt"))
