"""Learning-rate schedules (mmpo.training.lr_schedule): torch's schedulers give the values of the
hand-written warm-up / decay lambdas they replaced, for every shipped config; IGPO steps per optimizer step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from mmpo.training.lr_schedule import warmup_schedule

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def lr_sequence(steps: int, **settings) -> list[float]:
    """Learning rate of each of the first ``steps`` optimizer steps (peak lr 1.0)."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = warmup_schedule(optimizer, **settings)
    values = []
    for _ in range(steps):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values


def test_hand_computed_values():
    # warm-up 4 then linear to step 10: (s + 1) / 4 for s < 4, then (10 - s) / 6; held at 0 afterwards
    assert lr_sequence(13, warmup_steps=4, schedule="linear", total_steps=10) == pytest.approx(
        [0.25, 0.5, 0.75, 1.0, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0, 0.0, 0.0], abs=1e-15)
    # cosine from 1 to 0.1 over 4 steps after 2 warm-up steps, then held at the floor (no rise)
    floor = 0.1
    cos = [floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert lr_sequence(9, warmup_steps=2, schedule="cosine", total_steps=6, min_lr_ratio=floor) == pytest.approx(
        [0.5, 1.0, *cos, floor, floor], abs=1e-15)
    assert lr_sequence(4, warmup_steps=3) == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0], abs=1e-15)
    assert lr_sequence(3) == [1.0, 1.0, 1.0]


def test_bad_settings_fail_clearly():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="unknown schedule 'step'"):
        warmup_schedule(optimizer, schedule="step")
    with pytest.raises(ValueError, match="needs a positive total_steps"):
        warmup_schedule(optimizer, schedule="cosine")


def _old_factor(step: int, warmup: int, schedule: str, total: int | None, floor: float = 0.0) -> float:
    """The LambdaLR factor the modules used before (mmpo.algos.config / dllm / mmpo.robotics.bc)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    return floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _shipped_schedules() -> list[tuple[str, dict]]:
    """(config name, warmup_schedule settings) of every shipped config that has a schedule."""
    cases = []
    for path in sorted(CONFIGS.rglob("*.yaml")):
        config = yaml.safe_load(path.read_text()) or {}
        model = (config.get("model") or {}).get("init_args") or {}
        model = {**model, **(model.get("optim") or {})}  # the VLM modules' optimizer group (mmpo.training.config)
        if "warmup_steps" not in model and "lr_schedule" not in model and "lr_min" not in model:
            continue
        total = (config.get("trainer") or {}).get("max_steps", -1)
        total = total if total and total > 0 else 1000
        if "lr_min" in model or path.name.startswith("bc_"):  # BC: cosine to lr_min over all steps
            settings = dict(warmup_steps=min(model.get("warmup_steps", 100), total), schedule="cosine",
                            total_steps=total, min_lr_ratio=model.get("lr_min", 1e-5) / model.get("lr", 1e-4))
        else:
            settings = dict(warmup_steps=model.get("warmup_steps", 0), schedule=model.get("lr_schedule", "constant"),
                            total_steps=total)
        cases.append((str(path.relative_to(CONFIGS)), settings))
    return cases


SHIPPED = _shipped_schedules()


def test_shipped_configs_are_covered():
    names = {name for name, _ in SHIPPED}
    assert {"vlm/sft_tiny.yaml", "dllm/sft_tiny.yaml", "dllm/igpo_tiny.yaml", "robotics/bc_lift.yaml"} <= names


@pytest.mark.parametrize("name,settings", SHIPPED, ids=[name for name, _ in SHIPPED])
def test_same_sequence_as_the_replaced_lambda(name, settings):
    total = settings.get("total_steps") or 1000
    new = lr_sequence(total + 3, **settings)
    old = [_old_factor(s, settings["warmup_steps"], settings["schedule"], total, settings.get("min_lr_ratio", 0.0))
           for s in range(total + 3)]
    assert new == pytest.approx(old, rel=1e-12, abs=1e-15)
