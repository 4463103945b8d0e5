"""PAPO's pure pieces (arXiv 2507.06448): image masking, perception KL, double entropy, annealing.

All expected values are worked out by hand in the comments.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from mmpo.algos.papo import (
    annealed_coefficient,
    double_entropy,
    mask_seed,
    papo_extra_loss,
    perception_kl,
    random_patch_blackening,
    sequence_nll_entropy,
)

# ----------------------------------------------------------------------------- masking


def _white(width: int, height: int) -> Image.Image:
    return Image.new("RGB", (width, height), (255, 255, 255))


def test_blackening_cells_and_truncated_edges_hand_computed():
    # 30 x 28 image (W x H) with 14 px cells -> 2 rows x 3 cols; the last column is 2 px wide.
    # np.random.default_rng(0).random((2, 3)) = [[0.637, 0.270, 0.041], [0.017, 0.813, 0.913]]
    # a cell survives when u >= 0.6: [[keep, black, black], [black, keep, keep]]
    out = np.array(random_patch_blackening(_white(30, 28), cell_size=14, mask_prob=0.6, seed=0))
    assert out.shape == (28, 30, 3)
    expected_keep = [[True, False, False], [False, True, True]]
    col_slices = [slice(0, 14), slice(14, 28), slice(28, 30)]
    row_slices = [slice(0, 14), slice(14, 28)]
    for r, rows in enumerate(row_slices):
        for c, cols in enumerate(col_slices):
            cell = out[rows, cols]
            assert (cell == (255 if expected_keep[r][c] else 0)).all(), (r, c)


def test_blackening_is_deterministic_per_seed_and_keeps_size():
    image = Image.fromarray(np.random.default_rng(5).integers(0, 256, (45, 61, 3), dtype=np.uint8))
    a = random_patch_blackening(image, seed=3)
    b = random_patch_blackening(image, seed=3)
    c = random_patch_blackening(image, seed=4)
    assert a.size == image.size and a.mode == "RGB"
    assert np.array_equal(np.array(a), np.array(b))
    assert not np.array_equal(np.array(a), np.array(c))
    # unmasked pixels are untouched
    kept = np.array(a).sum(-1) > 0
    assert np.array_equal(np.array(a)[kept], np.array(image)[kept])


def test_blackening_extremes_and_rate():
    image = _white(56, 42)
    assert np.array_equal(np.array(random_patch_blackening(image, mask_prob=0.0, seed=1)), np.array(image))
    assert (np.array(random_patch_blackening(image, mask_prob=1.0, seed=1)) == 0).all()
    # 100 x 100 cells: the blackened fraction is close to p = 0.6 (binomial sd ~0.005)
    big = random_patch_blackening(_white(1400, 1400), cell_size=14, mask_prob=0.6, seed=7)
    black_fraction = float((np.array(big)[::14, ::14, 0] == 0).mean())
    assert abs(black_fraction - 0.6) < 0.02
    with pytest.raises(ValueError, match="mask_prob"):
        random_patch_blackening(image, mask_prob=1.5, seed=0)


def test_mask_seed_stable_and_distinct():
    assert mask_seed(0, 3, "item-1") == mask_seed(0, 3, "item-1")
    assert len({mask_seed(0, 3, "item-1"), mask_seed(0, 4, "item-1"), mask_seed(0, 3, "item-2"),
                mask_seed(1, 3, "item-1")}) == 4


# ----------------------------------------------------------------------------- perception KL

# Two sequences; the second has one real token and one padding token.
L = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]])  # original image log-probs
M = torch.tensor([[-2.0, -1.0], [-1.5, 3.0]])  # masked image log-probs (pad entry is junk)
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
# d = exp(m - l) - (m - l) - 1:
D1 = math.exp(-1.0) + 1.0 - 1.0  # m - l = -1 -> 0.367879
D2 = math.exp(1.0) - 1.0 - 1.0  # m - l = +1 -> 0.718282
D3 = math.exp(-1.0) + 1.0 - 1.0  # m - l = -1 -> 0.367879


def test_perception_kl_token_mean_hand_computed():
    kl, per_token = perception_kl(L, M, MASK, aggregation="token-mean")
    assert per_token[0].tolist() == pytest.approx([D1, D2])
    assert float(kl) == pytest.approx((D1 + D2 + D3) / 3)  # 0.484680


def test_perception_kl_honours_aggregation_mode():
    kl, _ = perception_kl(L, M, MASK, aggregation="seq-mean-token-mean")
    # seq 1 mean (D1 + D2) / 2 = 0.543081, seq 2 mean D3 = 0.367879 -> 0.455480
    assert float(kl) == pytest.approx(((D1 + D2) / 2 + D3) / 2)
    kl_global, _ = perception_kl(L, M, MASK, aggregation="token-mean", global_tokens=6)
    assert float(kl_global) == pytest.approx((D1 + D2 + D3) / 6)


def test_perception_kl_is_subtracted_so_gradient_increases_it():
    logp = L.clone().requires_grad_(True)
    term, metrics = papo_extra_loss(logp, M, MASK, gamma=0.1, eta_orig=0.0, eta_masked=0.0)
    assert float(term.detach()) == pytest.approx(-0.1 * (D1 + D2 + D3) / 3)  # -0.0484680
    assert float(metrics["papo/kl_prcp"]) == pytest.approx((D1 + D2 + D3) / 3)
    term.backward()
    # d d_t / d l_t = 1 - exp(m - l); loss grad = -gamma/3 * that.
    # token 1: 1 - e^-1 = 0.632121 -> -0.0210707; token 2: 1 - e = -1.718282 -> +0.0572761
    assert logp.grad[0].tolist() == pytest.approx(
        [-0.1 / 3 * (1 - math.exp(-1.0)), -0.1 / 3 * (1 - math.exp(1.0))], rel=1e-5
    )
    assert float(logp.grad[1, 1]) == 0.0  # padding carries no gradient
    # one gradient-descent step on the loss raises KL_prcp
    with torch.no_grad():
        stepped = logp - 1.0 * logp.grad
    assert float(perception_kl(stepped, M, MASK)[0]) > float(metrics["papo/kl_prcp"])


# ----------------------------------------------------------------------------- double entropy


def test_double_entropy_hand_computed():
    # H_orig = -(-1 - 2 - 0.5) / 3 = 1.166667; H_masked = -(-2 - 1 - 1.5) / 3 = 1.5
    assert float(sequence_nll_entropy(L, MASK)) == pytest.approx(3.5 / 3)
    term, parts = double_entropy(L, M, MASK, eta_orig=0.05, eta_masked=0.03)
    assert float(parts["entropy_orig"]) == pytest.approx(3.5 / 3)
    assert float(parts["entropy_masked"]) == pytest.approx(1.5)
    assert float(term) == pytest.approx(0.05 * 3.5 / 3 + 0.03 * 1.5)  # 0.0583333 + 0.045 = 0.1033333


def test_full_papo_term_and_detached_masked_branch():
    logp = L.clone().requires_grad_(True)
    masked = M.clone().requires_grad_(True)
    term, _ = papo_extra_loss(logp, masked.detach(), MASK, gamma=0.02, eta_orig=0.05, eta_masked=0.05)
    expected = -0.02 * (D1 + D2 + D3) / 3 + 0.05 * 3.5 / 3 + 0.05 * 1.5
    assert float(term.detach()) == pytest.approx(expected)
    term.backward()
    assert masked.grad is None  # official default: no gradient through the masked branch
    # with gradient through the masked branch, eta2 pushes masked log-probs up: d/dm = -eta2/3 + ...
    masked2 = M.clone().requires_grad_(True)
    term2, _ = papo_extra_loss(L, masked2, MASK, gamma=0.0, eta_orig=0.0, eta_masked=0.05)
    term2.backward()
    assert masked2.grad[0].tolist() == pytest.approx([-0.05 / 3, -0.05 / 3])


# ----------------------------------------------------------------------------- annealing


def test_annealed_coefficient_linear_then_flat():
    # 0.02 -> 0 over the first half of 100 steps
    assert annealed_coefficient(0, 100, start=0.02, end=0.0, annealing_ratio=0.5) == pytest.approx(0.02)
    assert annealed_coefficient(25, 100, start=0.02, end=0.0, annealing_ratio=0.5) == pytest.approx(0.01)
    assert annealed_coefficient(50, 100, start=0.02, end=0.0, annealing_ratio=0.5) == pytest.approx(0.0)
    assert annealed_coefficient(90, 100, start=0.02, end=0.0, annealing_ratio=0.5) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="annealing_ratio"):
        annealed_coefficient(0, 10, start=1.0, end=0.0, annealing_ratio=0.0)


# ----------------------------------------------------------------------------- real processor


@pytest.fixture(scope="module")
def tiny_processor(tmp_path_factory):
    from mmpo.vlm.factory import build_tiny_vlm, load_vlm

    path = build_tiny_vlm(tmp_path_factory.mktemp("papo_tiny"), corpus=["what is shown", "the answer is 3"])
    return load_vlm(path)[1]


def test_masked_image_gives_the_same_grid_through_the_real_processor(tiny_processor):
    from mmpo.vlm.processing import encode_prompts

    # an odd-sized raw image: the processor resizes both the same way
    image = Image.fromarray(np.random.default_rng(2).integers(0, 256, (45, 61, 3), dtype=np.uint8))
    masked = random_patch_blackening(image, seed=11)
    row = {"id": "papo-1", "images": [image], "problem": "what is shown", "answer": "3"}
    original = encode_prompts(tiny_processor, [row])
    with_mask = encode_prompts(tiny_processor, [{**row, "images": [masked]}])
    assert torch.equal(original["image_grid_thw"], with_mask["image_grid_thw"])
    assert torch.equal(original["input_ids"], with_mask["input_ids"])
    assert original["pixel_values"].shape == with_mask["pixel_values"].shape
    assert not torch.equal(original["pixel_values"], with_mask["pixel_values"])
