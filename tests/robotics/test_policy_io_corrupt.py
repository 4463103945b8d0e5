"""A truncated or damaged policy checkpoint gives one clear line naming the file, not `OSError: [Errno 22]`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmpo.robotics.bc import EMA_PREFIX
from mmpo.robotics.policy import DiffusionPolicy
from mmpo.robotics.policy.io import CorruptCheckpointError, load_policy, save_policy_safetensors
from mmpo.robotics.rollout_cli import rollout_main


def _metadata(policy: DiffusionPolicy) -> dict:
    return {"kind": "bc", "policy_config": policy.policy_config, "policy_prefix": EMA_PREFIX, "ft_steps": 0,
            "task": "lift", "act_steps": 2}


@pytest.fixture()
def checkpoint(tmp_path) -> Path:
    policy = DiffusionPolicy(2, 1, 2, denoising_steps=5, hidden_dims=[8, 8, 8])
    path = tmp_path / "bc.ckpt"
    torch.save({"state_dict": {EMA_PREFIX + k: v for k, v in policy.state_dict().items()},
                "robotics": _metadata(policy)}, path)
    load_policy(path)  # the intact file loads
    return path


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_rollout_on_a_truncated_checkpoint_names_the_file(checkpoint, keep, capsys):
    data = checkpoint.read_bytes()
    checkpoint.write_bytes(data[: int(len(data) * keep)])
    assert rollout_main(["--ckpt", str(checkpoint), "--episodes", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"error: checkpoint {checkpoint} ({int(len(data) * keep)} bytes) is truncated or corrupt")


def test_truncated_safetensors_export_is_named(tmp_path):
    policy = DiffusionPolicy(2, 1, 2, denoising_steps=5, hidden_dims=[8, 8, 8])
    path = save_policy_safetensors(policy, _metadata(policy), tmp_path / "policy.safetensors")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError, match=rf"checkpoint {path} \(100 bytes\) is truncated or corrupt"):
        load_policy(path)
