"""Load a diffusion or flow policy from a BC, DPPO, ReinFlow or FPO checkpoint (Lightning ``.ckpt`` or ``.safetensors``).

Every robotics checkpoint carries a ``"robotics"`` entry: the policy's constructor arguments,
the state-dict prefix of the weights to use (BC: the EMA copy; DPPO: base + fine-tuned copy),
``ft_steps`` (K', 0 for BC) and the environment settings (task, act_steps, normaliser stats path).
Rebuilding both networks with the same K' is what the official DPPO eval got wrong (issue #29).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from mmpo.robotics.policy.diffusion import DiffusionPolicy
from mmpo.robotics.policy.flow import FLOW_FAMILY, FlowPolicy


def _sidecar(path: Path) -> Path:
    return path.with_suffix(path.suffix + ".json")


class CorruptCheckpointError(ValueError):
    """A checkpoint file exists but cannot be read (truncated by a crash, or bytes damaged)."""


def _read_checkpoint(path: Path, read: Callable[[Path], Any]) -> Any:
    """``read(path)``, turning the readers' low-level failures into one error that names the file.

    A truncated zip makes ``torch.load`` raise ``OSError: [Errno 22]`` or ``EOFError``, a damaged
    one ``RuntimeError`` or an unpickling error; safetensors raises its own ``SafetensorError``.
    """
    try:
        return read(path)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError, SafetensorError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        size = path.stat().st_size
        detail = f"{type(error).__name__}: {error}".rstrip(": ")
        raise CorruptCheckpointError(
            f"checkpoint {path} ({size} bytes) is truncated or corrupt and cannot be loaded ({detail}); "
            "use an earlier checkpoint of the run"
        ) from error


def build_policy(metadata: dict[str, Any], state_dict: dict[str, torch.Tensor]) -> DiffusionPolicy | FlowPolicy:
    """The policy (DiffusionPolicy, or FlowPolicy for ``policy_config["family"] == "flow"``) from checkpoint metadata
    and its (un-prefixed) weights. A fine-tuned flow policy's metadata carries ``flow_finetune`` (its noise network
    settings, None for FPO), a fine-tuned diffusion policy's ``ft_steps`` K'."""
    config = dict(metadata["policy_config"])
    if config.pop("family", None) == FLOW_FAMILY:
        policy: DiffusionPolicy | FlowPolicy = FlowPolicy(**config)
        if metadata.get("flow_finetune") is not None:
            policy.enable_finetuning(metadata["flow_finetune"].get("noise"))
    else:
        policy = DiffusionPolicy(**config)
        if int(metadata.get("ft_steps", 0)) > 0:
            policy.enable_finetuning(int(metadata["ft_steps"]))
    policy.load_state_dict(state_dict, strict=True)
    return policy.eval()


def load_policy(path: str | Path) -> tuple[DiffusionPolicy | FlowPolicy, dict[str, Any]]:
    """(policy in eval mode, metadata) from a ``.ckpt`` (Lightning) or ``.safetensors`` (+ ``.json``) file; a DSRL
    ``.ckpt`` gives its :class:`~mmpo.robotics.dsrl.SteeredPolicy` (the frozen policy and the noise actor)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"policy checkpoint {path} does not exist")
    if path.suffix == ".safetensors":
        sidecar = _sidecar(path)
        if not sidecar.exists():
            raise FileNotFoundError(f"{path} needs its metadata file {sidecar}")
        metadata = json.loads(sidecar.read_text())
        return build_policy(metadata, _read_checkpoint(path, lambda p: load_file(str(p)))), metadata
    checkpoint = _read_checkpoint(path, lambda p: torch.load(p, map_location="cpu", weights_only=True))
    if "robotics" not in checkpoint:
        raise ValueError(f"{path} is not a robotics policy checkpoint (no 'robotics' metadata entry)")
    metadata = dict(checkpoint["robotics"])
    if str(metadata.get("kind", "")).startswith("gaussian"):
        raise ValueError(f"{path} holds a Gaussian policy (kind {metadata['kind']!r}), not a diffusion policy; "
                         "load it with mmpo.robotics.gaussian_ppo.load_gaussian_policy")
    if metadata.get("kind") == "dsrl":  # the frozen policy steered by its noise actor
        from mmpo.robotics.dsrl import build_steered_policy

        return build_steered_policy(metadata, checkpoint["state_dict"]), metadata
    prefix = metadata["policy_prefix"]
    state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    if not state:
        raise ValueError(f"{path}: no weights under prefix {prefix!r}")
    return build_policy(metadata, state), metadata


def save_policy_safetensors(policy: DiffusionPolicy | FlowPolicy, metadata: dict[str, Any], path: str | Path) -> Path:
    """Write the policy's weights as safetensors and its metadata as ``<path>.json``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in policy.state_dict().items()}
    save_file(state, str(path))
    meta = dict(metadata, policy_config=policy.policy_config, ft_steps=policy.ft_steps, policy_prefix="")
    if isinstance(policy, FlowPolicy):
        meta["flow_finetune"] = policy.finetune_config
    _sidecar(path).write_text(json.dumps(meta, indent=2))
    return path
