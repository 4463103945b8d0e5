"""Shared by the data-parallel equivalence tests (tests/e2e/test_ddp_vlm.py, test_fsdp_vlm.py, test_fsdp_ppo.py):
the tiny VLM they train and the launchers of tests/fixed_grpo_worker.py, tests/fixed_sft_worker.py,
tests/fixed_preference_worker.py and tests/fixed_ppo_worker.py."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("fixed_grpo_worker.py")
SFT_WORKER = Path(__file__).with_name("fixed_sft_worker.py")
PREFERENCE_WORKER = Path(__file__).with_name("fixed_preference_worker.py")
PPO_WORKER = Path(__file__).with_name("fixed_ppo_worker.py")


def build_data_parallel_tiny(directory: Path) -> str:
    """The tiny Qwen2.5-VL both prompts of the fixed rollout tokenize with (count_shapes, arithmetic)."""
    from mmpo.data import SYSTEM_PROMPT
    from mmpo.data.synthetic import corpus
    from mmpo.vlm.factory import build_tiny_vlm

    texts = [SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)]
    return str(build_tiny_vlm(directory, corpus=texts, vocab_size=400, hidden_size=64, intermediate_size=128))


def run_fixed_grpo(tmp_path: Path, mode: str, tiny_path: str, name: str, *, agg: str = "token-mean",
                   steps: int = 1, beta: float = 0.0, momentum: float = 0.0, ckpt_dir: Path | str = "-",
                   resume: Path | str = "-", max_grad_norm: float = 0.0, lora: bool = False,
                   expect_ok: bool = True) -> tuple[dict[str, torch.Tensor], str]:
    """Run tests/fixed_grpo_worker.py (MODE single, ddp or fsdp; ``lora``: with grpo_tiny_lora.yaml's adapter);
    returns its final full weights and its
    stdout (with ``expect_ok=False``: no weights, and stdout + stderr of a run that must fail)."""
    out = tmp_path / f"{name}.safetensors"
    args = [mode, tiny_path, str(out), agg, str(steps), str(beta), str(momentum), str(ckpt_dir), str(resume),
            str(max_grad_norm), str(int(lora))]
    return run_worker(WORKER, args, tmp_path, out, expect_ok=expect_ok)


def run_fixed_grpo_nodes(tmp_path: Path, tiny_path: str, name: str, *, nodes: int = 2, steps: int = 1,
                         beta: float = 0.0, momentum: float = 0.0, ckpt_dir: Path | str = "-",
                         resume: Path | str = "-", max_grad_norm: float = 0.0) -> tuple[dict[str, torch.Tensor], str]:
    """tests/fixed_grpo_worker.py (MODE torchrun) as ``nodes`` simulated nodes of 1 process each: one
    ``torchrun --nnodes N --node_rank K --master_addr 127.0.0.1 --nproc_per_node 1`` per node, started
    together as on N machines. Returns the final full weights and rank 0's stdout."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun, "torchrun not found beside the Python running the tests"
    out = tmp_path / f"{name}.safetensors"
    with socket.socket() as probe:  # a free port for the rendezvous store on node 0
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    worker_args = ["torchrun", tiny_path, str(out), "token-mean", str(steps), str(beta), str(momentum), str(ckpt_dir),
                   str(resume), str(max_grad_norm), "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    launches = [subprocess.Popen([torchrun, "--nnodes", str(nodes), "--node_rank", str(rank), "--master_addr",
                                  "127.0.0.1", "--master_port", str(port), "--nproc_per_node", "1", str(WORKER),
                                  *worker_args], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for rank in range(nodes)]
    logs = []
    try:
        for launch in launches:
            logs.append(launch.communicate(timeout=600)[0])
    finally:
        for launch in launches:
            if launch.poll() is None:
                launch.kill()
    for rank, (launch, log) in enumerate(zip(launches, logs)):
        assert launch.returncode == 0, f"node {rank}:\n{log[-4000:]}"
    return load_file(out), logs[0]


def run_fixed_sft(tmp_path: Path, mode: str, tiny_path: str, kind: str = "vlm") -> dict[str, torch.Tensor]:
    """Run tests/fixed_sft_worker.py (MODE ddp or fsdp; KIND vlm or text); returns its final full weights."""
    out = tmp_path / f"sft_{mode}.safetensors"
    return run_worker(SFT_WORKER, [mode, tiny_path, str(out), kind], tmp_path, out)[0]


def run_fixed_preference(tmp_path: Path, algo: str, mode: str, tiny_path: str, name: str, *, steps: int = 2,
                         ckpt_dir: Path | str = "-", resume: Path | str = "-", pairs: str = "both",
                         timeout_s: float = 120.0, agree: str = "ranks", kind: str = "vlm",
                         expect_ok: bool = True) -> tuple[dict[str, torch.Tensor], str]:
    """Run tests/fixed_preference_worker.py (ALGO dpo or inpo, MODE single or fsdp); returns its final full
    weights (INPO: also ``anchor.`` and ``reference.`` ones) and its stdout (with ``expect_ok=False``: no
    weights, and stdout + stderr of a run that must fail)."""
    out = tmp_path / f"{name}.safetensors"
    args = [algo, mode, tiny_path, str(out), str(steps), str(ckpt_dir), str(resume), pairs, str(timeout_s), agree, kind]
    return run_worker(PREFERENCE_WORKER, args, tmp_path, out, expect_ok=expect_ok)


def run_fixed_ppo(tmp_path: Path, mode: str, tiny_path: str, name: str, *, steps: int = 2,
                  ckpt_dir: Path | str = "-", resume: Path | str = "-",
                  optimizer: str = "sgd") -> tuple[dict[str, torch.Tensor], str]:
    """Run tests/fixed_ppo_worker.py (MODE single or fsdp, OPTIMIZER sgd or adamw); returns its final full
    weights (``policy.*``, ``critic.*``), the last step's ``values`` and ``returns``, and its stdout."""
    out = tmp_path / f"{name}.safetensors"
    args = [mode, tiny_path, str(out), str(steps), str(ckpt_dir), str(resume), optimizer]
    return run_worker(PPO_WORKER, args, tmp_path, out)


def run_worker(script: Path, args: list[str], cwd: Path, out: Path, *,
               expect_ok: bool = True) -> tuple[dict[str, torch.Tensor], str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                            timeout=600, cwd=cwd)
    if not expect_ok:
        assert result.returncode != 0, result.stdout[-3000:]
        return {}, result.stdout + result.stderr
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return load_file(out), result.stdout
