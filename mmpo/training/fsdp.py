"""``FSDP2Strategy``: Lightning's ``ModelParallelStrategy`` as pure FSDP2 data parallelism, with verified
sharded checkpoints.

Lightning's ``ModelParallelStrategy`` runs FSDP2 (``fully_shard``, applied by the module's
``configure_model``; the VLM modules shard with :func:`mmpo.vlm.fsdp.shard_vlm`) on GPUs and, with the
gloo backend, on CPU processes. This strategy fixes its mesh to one data-parallel dimension over all
processes (``tensor_parallel_size`` 1: mmpo shards, it does not split layers), and keeps mmpo's
checkpoint guarantees for the sharded (distributed) checkpoints it writes, which bypass the
``CheckpointIO`` plugin (``VerifiedCheckpointIO`` guards single-file checkpoints only):

- **atomic**: every rank writes its shard into a staging directory beside the target; only when all
  have finished does rank 0 write a ``SHA256SUMS`` manifest (``sha256sum -c`` format) over every file,
  keep the checkpoint it replaces as ``<name>.prev.ckpt`` when that one verifies, and rename the
  staging directory into place. A save that fails leaves the old checkpoint untouched.
- **verified load**: every file must match the manifest (a directory without one loads with a
  warning), and the loaded weights and optimizer state must be finite; otherwise
  ``CorruptCheckpointError`` names the checkpoint.
- **a module's own sharded state**: tensors a module names in ``sharded_checkpoint_tensors()`` (INPO's
  anchor pi_t, a sharded frozen model outside the module tree) are saved by every rank into
  ``extra_state/`` inside the checkpoint and loaded back into them in place (Lightning would write them
  into ``meta.pt``, rank 0's shards only).
"""

from __future__ import annotations

import os
import shutil
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden

from mmpo.training.checkpoint import (
    CorruptCheckpointError,
    _fsync_directory,
    _mismatch_reason,
    checksum_status,
    corrupt_checkpoint_error,
    file_sha256,
    previous_path,
)

MANIFEST = "SHA256SUMS"
#: a module's own sharded tensors beside its weights (INPO's anchor pi_t), a DCP checkpoint of its own
EXTRA_STATE_DIR = "extra_state"
#: the module method that names them: ``sharded_checkpoint_tensors() -> dict[str, Tensor]`` (live tensors,
#: saved with the checkpoint and loaded back into them in place)
EXTRA_STATE_HOOK = "sharded_checkpoint_tensors"


def write_manifest(directory: Path) -> Path:
    """``SHA256SUMS`` over every file below ``directory`` (relative paths, ``sha256sum -c`` format)."""
    lines = [f"{file_sha256(path)}  {path.relative_to(directory).as_posix()}"
             for path in sorted(directory.rglob("*")) if path.is_file() and path.name != MANIFEST]
    manifest = directory / MANIFEST
    with open(manifest, "w") as handle:
        handle.write("\n".join(lines) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return manifest


def manifest_problem(directory: _PATH) -> str | None:
    """Why the sharded checkpoint ``directory`` does not match its manifest (None when it does).

    Returns ``"missing"`` when it has no manifest (written by another tool or an older mmpo).
    """
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return "missing"
    listed: dict[str, str] = {}
    for line in manifest.read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            listed[name.strip()] = digest
    present = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST}
    for name in sorted(set(listed) | present):
        if name not in present:
            return f"{name} listed in {MANIFEST} is missing"
        if name not in listed:
            return f"{name} is not listed in {MANIFEST}"
        if file_sha256(directory / name) != listed[name]:
            return f"{name} does not match {MANIFEST} (bytes changed after it was written)"
    return None


def _local_tensors(value: Any) -> list[torch.Tensor]:
    """This rank's shards of every floating tensor in a (nested) state."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return [value.to_local()]
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _local_tensors(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _local_tensors(item)]
    return []


def all_finite(*states: Any) -> bool:
    """True when every floating tensor (this rank's shards) in ``states`` is finite."""
    return all(bool(torch.isfinite(t).all()) for state in states for t in _local_tensors(state)
               if t.is_floating_point())


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over all processes (one data-parallel mesh dimension) with verified sharded checkpoints.

    Use it as ``trainer.strategy: {class_path: mmpo.training.fsdp.FSDP2Strategy}`` with a module that
    shards itself in ``configure_model`` (mmpo's VLM modules: SFT, the GRPO family, DPO, INPO).

    Checkpoints are always sharded (each rank writes its own shard into the checkpoint directory);
    the full weights are the HF export (``output_dir``).

    Args:
        process_group_backend: None = nccl on GPUs, gloo on CPU.
        timeout: collective timeout.
        keep_previous: keep the replaced sharded checkpoint as ``<name>.prev.ckpt`` when it verifies.
    """

    def __init__(
        self,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        keep_previous: bool = True,
    ) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=True,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.keep_previous = keep_previous

    def setup_environment(self) -> None:
        # every process is a data-parallel rank (ModelParallelStrategy's "auto" is one per node)
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        if module is not None and not is_overridden("configure_model", module):
            raise TypeError(f"{type(module).__name__} does not shard itself (no configure_model), so it cannot run "
                            "under FSDP2Strategy. FSDP2 is supported for mmpo's VLM modules (SFTModule, the "
                            "GRPO family, DPO and INPO); use strategy ddp for the others.")
        super().setup(trainer)

    def _extra_tensors(self) -> dict[str, torch.Tensor]:
        hook = getattr(self.lightning_module, EXTRA_STATE_HOOK, None)
        return dict(hook()) if callable(hook) else {}

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Optional[Any] = None) -> None:
        path = Path(self.broadcast(filepath))
        staging = path.with_name(f".{path.name}.staging")
        if self.is_global_zero and staging.exists():
            shutil.rmtree(staging)  # left by a save that died
        self.barrier()
        super().save_checkpoint(checkpoint, staging, storage_options)
        extra = self._extra_tensors()
        if extra:  # every rank writes its shards of them (Lightning would put them in meta.pt, rank 0's only)
            from torch.distributed.checkpoint import save

            save({"extra": extra}, checkpoint_id=staging / EXTRA_STATE_DIR)
        self.barrier()  # every shard is written
        if self.is_global_zero:
            write_manifest(staging)
            if path.is_dir() and self.keep_previous and manifest_problem(path) is None:
                previous = previous_path(path)
                _remove(previous)
                os.replace(path, previous)
            else:
                _remove(path)
            os.replace(staging, path)
            _fsync_directory(path.parent)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir():
            problem = self.broadcast(manifest_problem(path) if self.is_global_zero else None)
            if problem == "missing":
                warnings.warn(f"sharded checkpoint {path} has no {MANIFEST} (written by another tool?); loading it "
                              "with finite-value checks only", stacklevel=2)
            elif problem is not None:
                previous = previous_path(path)
                hint = (f"The previous checkpoint {previous} verifies; resume from it (--ckpt_path {previous})."
                        if previous.is_dir() and manifest_problem(previous) is None
                        else "No verified previous checkpoint is kept beside it.")
                raise CorruptCheckpointError(f"checkpoint {path} is damaged and was not loaded: {problem}. {hint}")
        elif path.is_file():
            # a single-file checkpoint (e.g. of a DDP run: Lightning loads it into the shards), read
            # here without the CheckpointIO: at least its checksum sidecar is checked
            if self.broadcast(checksum_status(path) == "mismatch" if self.is_global_zero else None):
                raise corrupt_checkpoint_error(path, _mismatch_reason(path))
        if path.is_dir() and (path / "meta.pt").is_file():
            metadata = self._load_sharded(path, weights_only=weights_only)
        else:
            metadata = super().load_checkpoint(path, weights_only=weights_only)
        extra = self._extra_tensors()
        if extra and path.is_dir():
            from torch.distributed.checkpoint import load

            if not (path / EXTRA_STATE_DIR).is_dir():
                raise CorruptCheckpointError(f"checkpoint {path} has no {EXTRA_STATE_DIR}/ (the sharded state of "
                                             f"{type(self.lightning_module).__name__} beside its weights)")
            load({"extra": extra}, checkpoint_id=path / EXTRA_STATE_DIR)  # in place, each rank its shards
        finite = all_finite(self.lightning_module.state_dict(), [o.state_dict()["state"] for o in self.optimizers],
                            extra)
        if not self.reduce_boolean_decision(finite, all=True):
            raise CorruptCheckpointError(f"checkpoint {path} is damaged: its weights or optimizer state hold NaN or "
                                         "inf; the run stops before any step")
        return metadata


    def _load_sharded(self, path: Path, *, weights_only: Optional[bool]) -> dict[str, Any]:
        """Lightning's sharded-checkpoint load (``lightning.fabric.strategies.model_parallel._load_checkpoint``)
        with one difference: a parameter that had no optimizer state when the checkpoint was written (it had
        never taken a step: PPO's policy during its critic warm-up) is not looked for in the checkpoint and
        starts without state, as in the uninterrupted run, where the optimizer creates it on its first step.
        (Lightning asks the checkpoint for the state of every parameter and fails on the missing ones.)"""
        from lightning.fabric.strategies.fsdp import _distributed_checkpoint_load
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        module = self.model
        strict = self.lightning_module.strict_loading
        module_state = {"state_dict": get_model_state_dict(module)}
        _distributed_checkpoint_load(module_state, path)
        module.load_state_dict(module_state["state_dict"], strict=strict)
        saved = set(FileSystemReader(path).read_metadata().state_dict_metadata)
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            wanted = get_optimizer_state_dict(module, optimizer)  # a state for every parameter (zero-lr step)
            wanted["state"] = {fqn: state for fqn, state in wanted["state"].items()
                               if any(f"{key}.state.{fqn}.{name}" in saved for name in state)}
            optim_state = {key: wanted}
            _distributed_checkpoint_load(optim_state, path)
            set_optimizer_state_dict(module, optimizer, optim_state_dict=optim_state[key],
                                     options=StateDictOptions(cpu_offload=True, strict=False))
        return torch.load(path / "meta.pt", weights_only=weights_only)  # everything not a module or optimizer


def check_sharding_support(strategy: Any) -> None:
    """Refuse, with a clear message, a sharded strategy the VLM modules do not run under.

    Lightning's ``fsdp`` strategy (FSDP1, ``FullyShardedDataParallel``) and tensor parallelism are not
    supported: the VLM modules shard with FSDP2 (``FSDP2Strategy``).
    """
    from lightning.pytorch.strategies import FSDPStrategy

    if isinstance(strategy, FSDPStrategy):
        raise ValueError("trainer.strategy fsdp (Lightning's FSDPStrategy, FSDP1) is not supported by mmpo's VLM "
                         "modules; use FSDP2: strategy: {class_path: mmpo.training.fsdp.FSDP2Strategy} (docs/fsdp.md)")
    if isinstance(strategy, ModelParallelStrategy) and not isinstance(strategy, FSDP2Strategy):
        raise ValueError("trainer.strategy ModelParallelStrategy (tensor parallelism) is not supported by mmpo's VLM "
                         "modules; use strategy: {class_path: mmpo.training.fsdp.FSDP2Strategy} (docs/fsdp.md)")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()

