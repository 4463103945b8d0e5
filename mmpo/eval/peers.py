"""Peer implementations' own code for the parity scripts (bench/parity_*.py), read at a pinned version.

verl is read from a git checkout or mirror with ``git show <commit>:<path>`` (:func:`git_show`,
:func:`load_verl`), TRL from its wheel (:func:`trl_source`); nothing of either peer is stored in this
repository. Where the verl clone is: a command-line option of each script, else the ``MMPO_VERL_GIT_DIR``
environment variable (:func:`verl_git_dir`).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

VERL_COMMIT = "b178a3cd"
"""The verl commit the parity scripts (and mmpo's verl-named code) cite."""
VERL_GIT_DIR_ENV = "MMPO_VERL_GIT_DIR"
DTYPE = torch.float64


def verl_git_dir(value: str | None) -> str:
    """The verl git dir: ``value`` (a command-line option), else ``$MMPO_VERL_GIT_DIR``; a clear error when
    neither names one."""
    git_dir = value or os.environ.get(VERL_GIT_DIR_ENV)
    if not git_dir:
        raise SystemExit(f"no verl clone given: pass --verl-git-dir PATH/TO/verl (a checkout's .git or a mirror "
                         f"holding commit {VERL_COMMIT}) or set {VERL_GIT_DIR_ENV}")
    return git_dir


def git_show(git_dir: str, commit: str, path: str) -> str:
    """The text of ``path`` at ``commit`` in the git repository ``git_dir`` (``git --git-dir DIR show``)."""
    return subprocess.run(["git", "--git-dir", git_dir, "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def function_source(source: str, name: str, class_name: str | None = None) -> str:
    """The source of top-level function ``name`` (or method ``class_name.name``) in ``source``."""
    tree = ast.parse(source)
    scope = tree.body
    if class_name is not None:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name).body
    node = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []  # drop @staticmethod / @torch.no_grad(); the caller wraps what it needs
    return ast.unparse(node)


def load_verl(git_dir: str, commit: str = VERL_COMMIT) -> types.ModuleType:
    """verl's core_algos at ``commit`` (default VERL_COMMIT) with stub modules for what it imports from verl /
    omegaconf; ``masked_sum`` / ``masked_mean`` are verl's own, taken from the same commit by their source."""
    functional = types.ModuleType("verl.utils.torch_functional")
    tf_source = git_show(git_dir, commit, "verl/utils/torch_functional.py")
    namespace: dict[str, Any] = {"torch": torch}
    for fn in ("masked_sum", "masked_mean"):
        exec(function_source(tf_source, fn), namespace)  # verl's own helpers, by source
        setattr(functional, fn, namespace[fn])

    class Holder:  # stands in for verl's config dataclasses (only attribute access is used)
        def __init__(self, **kw: Any) -> None:
            self.__dict__.update(kw)

    stubs = {
        "omegaconf": {"DictConfig": Holder},
        "verl": {},
        "verl.utils": {"as_torch_index": None, "group_mean_std": None, "torch_functional": functional},
        "verl.utils.import_utils": {"deprecated": lambda *a, **k: (lambda f: f)},
        "verl.trainer": {},
        "verl.trainer.config": {"AlgoConfig": type("AlgoConfig", (), {})},
        "verl.workers": {},
        "verl.workers.config": {"ActorConfig": Holder},
    }
    for name, attrs in stubs.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules.setdefault(name, module)
    sys.modules["verl.utils.torch_functional"] = functional
    tmp = Path(tempfile.mkdtemp()) / "verl_core_algos.py"
    tmp.write_text(git_show(git_dir, commit, "verl/trainer/ppo/core_algos.py"))
    spec = importlib.util.spec_from_file_location("verl_core_algos", tmp)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.Config = Holder
    return module


def trl_source(wheel: str | None, member: str) -> str:
    """The source of ``member`` (e.g. ``trl/trainer/dpo_trainer.py``) from the TRL 1.16.0 wheel
    (downloaded with ``pip download`` when ``wheel`` is None)."""
    import zipfile

    if wheel is None:
        out = Path(tempfile.mkdtemp())
        subprocess.run([sys.executable, "-m", "pip", "download", "trl==1.16.0", "--no-deps", "-d", str(out)],
                       check=True, capture_output=True)
        wheel = str(next(out.glob("trl-1.16.0-*.whl")))
    return zipfile.ZipFile(wheel).read(member).decode()


def trl_grpo_trainer_source(wheel: str | None) -> str:
    """The source of ``trl/trainer/grpo_trainer.py`` from the TRL 1.16.0 wheel (downloaded when None)."""
    return trl_source(wheel, "trl/trainer/grpo_trainer.py")


@dataclass
class Batch:
    """A seeded batch of token log-probs for the loss parity scripts (see :func:`make_batch`)."""

    log_probs: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor
    adv: torch.Tensor  # (B,)
    mask: torch.Tensor
    lengths: list[int] = field(default_factory=list)


def make_batch(seed: int = 0, spread: float = 0.3) -> Batch:
    """Eight float64 sequences of lengths 1..12: token log-probs near a softmax's (``old``), the current and
    reference ones ``spread`` away, one advantage per sequence and the padding mask, all from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [12, 3, 7, 1, 9, 12, 5, 10]
    batch, time = len(lengths), max(lengths)
    old = torch.log_softmax(torch.randn(batch, time, 13, generator=gen, dtype=DTYPE), -1)[..., 0]
    lp = old + spread * torch.randn(batch, time, generator=gen, dtype=DTYPE)
    ref = old + spread * torch.randn(batch, time, generator=gen, dtype=DTYPE)
    adv = 1.5 * torch.randn(batch, generator=gen, dtype=DTYPE)
    mask = torch.zeros(batch, time, dtype=DTYPE)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return Batch(lp, old, ref, adv, mask, lengths)
