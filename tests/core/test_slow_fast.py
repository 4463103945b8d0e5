"""SFPO's slow-fast update and entropy switch (arXiv 2510.04072; Urheen/SFPO), by hand."""

import math

import pytest
import torch

from mmpo.core.slow_fast import EntropyZScoreSwitch, reposition, slow_fast_update


def test_reposition_hand_computed():
    param = torch.nn.Parameter(torch.tensor([3.0, 0.0]))  # the fast weights
    reposition([param], [torch.tensor([1.0, 2.0])], 0.8)
    # 1 + 0.8 (3 - 1) = 2.6; 2 + 0.8 (0 - 2) = 0.4
    assert param.tolist() == pytest.approx([2.6, 0.4])


def test_slow_fast_update_on_a_quadratic():
    # loss (w - 1)^2, SGD lr 0.1: one update maps w -> w - 0.2 (w - 1) = 0.8 w + 0.2
    w = torch.nn.Parameter(torch.zeros(()))
    frozen = torch.nn.Parameter(torch.ones(()), requires_grad=False)
    optimizer = torch.optim.SGD([w], lr=0.1)
    seen = []

    def update() -> float:
        optimizer.zero_grad()
        ((w - 1) ** 2 + frozen).backward()
        optimizer.step()
        seen.append(float(w.detach()))
        return float(w.detach())

    out = slow_fast_update([w, frozen], update, inner_steps=3, alpha=0.8)
    # fast: 0.2, 0.36, 0.488; reposition 0 + 0.8 * 0.488 = 0.3904; slow: 0.8 * 0.3904 + 0.2 = 0.51232
    assert seen == pytest.approx([0.2, 0.36, 0.488, 0.51232])
    assert out == pytest.approx(0.51232) and float(w.detach()) == pytest.approx(0.51232)
    assert float(frozen) == 1.0
    with pytest.raises(ValueError, match="alpha"):
        slow_fast_update([w], update, inner_steps=3, alpha=0.0)
    with pytest.raises(ValueError, match="inner_steps"):
        slow_fast_update([w], update, inner_steps=0, alpha=0.8)


def test_entropy_switch_hand_computed_and_state():
    switch = EntropyZScoreSwitch(window=3, threshold=1.0)
    for h in (1.0, 1.0):
        switch.record(h)
    assert switch.check() and math.isnan(switch.last_z)  # fewer than W recorded: no z yet
    switch.record(1.0)
    assert switch.check() and switch.last_z == 0.0  # [1, 1, 1]: z = 0 / (0 + 1e-9)
    switch.record(2.0)
    # last 3 = [1, 1, 2]: mean 4/3, population std sqrt(2/9) = 0.471405; z = (2 - 4/3) / 0.471405 = 1.414214
    assert not switch.check()
    assert switch.last_z == pytest.approx(math.sqrt(2), rel=1e-6)
    switch.record(1.0)
    switch.record(1.0)
    assert not switch.check()  # off for good, whatever the entropy does next
    restored = EntropyZScoreSwitch(window=3, threshold=1.0)
    restored.load_state_dict(switch.state_dict())
    assert restored.stopped and restored.entropies == [2.0, 1.0, 1.0]  # only the last W are kept
    with pytest.raises(ValueError, match="window"):
        EntropyZScoreSwitch(window=1)
