"""GRPOModule's rollout_engine setting is checked before the model loads (these run in every venv; the
vLLM backend itself is tested in the vLLM venv: tests/vlm/test_vllm_engine.py)."""

from __future__ import annotations

import pytest

from mmpo.training.config import EngineConfig
import mmpo.vlm.vllm_engine as vllm_engine
from mmpo.algos.grpo import GRPOModule


def test_unknown_rollout_engine_is_refused():
    with pytest.raises(ValueError, match="rollout_engine must be hf or vllm, got 'sglang'"):
        GRPOModule("does/not/matter", rollout_engine=EngineConfig(name="sglang"))


def test_vllm_without_vllm_names_the_install(monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    with pytest.raises(ValueError, match="scripts/install_vllm_cpu.sh"):
        GRPOModule("does/not/matter", rollout_engine=EngineConfig(name="vllm"))


def test_vllm_with_lora_is_refused(monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: True)
    with pytest.raises(ValueError, match="lora_rank > 0 use rollout_engine: hf"):
        GRPOModule("does/not/matter", rollout_engine=EngineConfig(name="vllm"), lora_rank=8)


@pytest.mark.parametrize("module", ["mmpo.algos.agent:AgentGRPOModule", "mmpo.algos.arpo:ARPOModule",
                                    "mmpo.algos.matpo:MATPOModule"])
def test_agent_arpo_and_matpo_accept_vllm_rollouts(monkeypatch, module):
    """Their multi-turn rollouts run on vLLM (tests/llm/test_vllm_arpo.py and test_vllm_matpo.py in the vLLM venv):
    the settings pass, and construction stops only at the missing model."""
    import importlib

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: True)
    name, cls = module.split(":")
    with pytest.raises(FileNotFoundError, match="no config.json in does/not/matter"):
        getattr(importlib.import_module(name), cls)("does/not/matter", rollout_engine=EngineConfig(name="vllm"))


def test_dialtree_with_vllm_is_refused(monkeypatch):
    from mmpo.algos.dialtree import DialTreeModule

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: True)
    with pytest.raises(ValueError, match="dialtree: tree rollouts run on rollout_engine: hf"):
        DialTreeModule("does/not/matter", rollout_engine=EngineConfig(name="vllm"))
