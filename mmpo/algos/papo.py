"""PAPO: Perception-Aware Policy Optimization (arXiv 2507.06448).

GRPO (PAPO-G) or DAPO (PAPO-D) plus two terms that make the policy *look* at the image:

1. Mask the raw image: black out 14 x 14 pixel cells, each with probability 0.6, one mask per
   prompt shared by its whole group (:func:`random_patch_blackening`).
2. Score the sampled tokens again with the masked image: m_t = log pi(o_t | q, I_m, o_<t), once
   per step and without gradient (official behaviour; ``masked_with_grad`` recomputes it with
   gradient in every minibatch instead).
3. Implicit perception loss: per-token k3 KL between the original-image policy (l_t) and the
   masked-image policy (m_t), d_t = exp(m - l) - (m - l) - 1, aggregated like the policy loss and
   SUBTRACTED with coefficient gamma (the KL is maximised) (:func:`perception_kl`).
4. Double entropy regulariser: + eta1 H(orig) + eta2 H(masked), H = token-mean NLL of the
   sampled tokens, which keeps both entropies low and guards against "KL_prcp hacking"
   (:func:`double_entropy`).
5. Optional linear annealing of gamma; the entropy coefficients follow the same discount
   (:func:`annealed_coefficient`).

Sources: paper Eq. 2 and App. B/G.1; official code ``MikeWangWZHL/PAPO``
(``verl/trainer/papo_utils.py``, ``verl/workers/actor/dp_actor.py``); see
``/work/shared/research/vlm_algos.md`` section 1.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from mmpo.core.aggregate import aggregate
from mmpo.core.kl import kl_penalty

# --------------------------------------------------------------------------------------------
# Step 1: the masked image
# --------------------------------------------------------------------------------------------


def mask_seed(base_seed: int, step: int, row_id: str) -> int:
    """A stable per-(run seed, step, prompt) seed for the image mask.

    Python's ``hash`` of a str is salted per process, so crc32 keeps masks reproducible across
    runs and resumes.
    """
    return zlib.crc32(f"{base_seed}:{step}:{row_id}".encode()) & 0x7FFFFFFF


def random_patch_blackening(
    image: Image.Image, *, cell_size: int = 14, mask_prob: float = 0.6, seed: int
) -> Image.Image:
    """Black out random ``cell_size`` x ``cell_size`` pixel cells of a RAW image (PAPO, arXiv 2507.06448, App. G.1).

    The image is tiled from its top-left corner; cells at the right/bottom edges are truncated to
    the image. Each cell is set to 0 independently with probability ``mask_prob``. The output
    has the original size, so the processor resizes it to the same grid
    (``image_grid_thw``) and the prompt's image-pad tokens can be reused unchanged.

    Args:
        image: a PIL image of any size; modes other than RGB and L are converted to RGB first
            (as the official pipeline does before the processor).
        cell_size: cell side in pixels (paper: 14).
        mask_prob: probability that a cell is blackened (paper: 0.6).
        seed: seed of the mask; equal seeds give equal masks.

    Returns:
        A new PIL image of the same size (RGB or L).
    """
    if cell_size <= 0:
        raise ValueError(f"cell_size must be positive, got {cell_size}")
    if not 0.0 <= mask_prob <= 1.0:
        raise ValueError(f"mask_prob must be in [0, 1], got {mask_prob}")
    if image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    pixels = np.array(image)
    height, width = pixels.shape[:2]
    rows, cols = -(-height // cell_size), -(-width // cell_size)  # ceil: edge cells included
    keep_cell = np.random.default_rng(seed).random((rows, cols)) >= mask_prob
    keep_pixel = np.repeat(np.repeat(keep_cell, cell_size, axis=0), cell_size, axis=1)[:height, :width]
    if pixels.ndim == 3:
        keep_pixel = keep_pixel[:, :, None]
    masked = (pixels * keep_pixel).astype(pixels.dtype)
    return Image.fromarray(masked)


# --------------------------------------------------------------------------------------------
# Step 3: implicit perception loss
# --------------------------------------------------------------------------------------------


def perception_kl(
    log_probs: Tensor,
    masked_log_probs: Tensor,
    mask: Tensor,
    *,
    aggregation: str = "token-mean",
    **aggregate_kwargs,
) -> tuple[Tensor, Tensor]:
    """KL_prcp = KL(pi(. | q, I) || pi(. | q, I_m)) estimated with k3 on the sampled tokens.

    d_t = exp(m_t - l_t) - (m_t - l_t) - 1 (log-ratio clamped to +-20, result to [-10, 10],
    the official ``low_var_kl``), aggregated with the policy loss's mode. PAPO subtracts
    ``gamma * KL_prcp`` from the loss.

    Args:
        log_probs: ``(batch, time)`` l_t, policy log-probs with the original image (with grad).
        masked_log_probs: ``(batch, time)`` m_t, the same tokens with the masked image.
        mask: ``(batch, time)`` real completion tokens.
        aggregation: an ``mmpo.core.aggregate`` mode (the policy loss's).
        **aggregate_kwargs: forwarded to ``aggregate`` (``global_tokens`` etc.).

    Returns:
        ``(kl_prcp, per_token)``: the aggregated 0-d value and the ``(batch, time)`` d_t.
    """
    per_token = kl_penalty(log_probs, masked_log_probs, "k3")
    return aggregate(per_token, mask, aggregation, **aggregate_kwargs), per_token


# --------------------------------------------------------------------------------------------
# Step 4: double entropy regulariser
# --------------------------------------------------------------------------------------------


def sequence_nll_entropy(log_probs: Tensor, mask: Tensor, **aggregate_kwargs) -> Tensor:
    """PAPO's entropy estimate: the token-mean NLL of the sampled tokens, -mean_t l_t.

    Args:
        log_probs: ``(batch, time)`` log-probs of the sampled tokens.
        mask: ``(batch, time)`` real tokens.
        **aggregate_kwargs: forwarded to ``aggregate`` (``global_tokens`` for micro-batching).

    Returns:
        0-d tensor.
    """
    return aggregate(-log_probs, mask, "token-mean", **aggregate_kwargs)


def double_entropy(
    log_probs: Tensor,
    masked_log_probs: Tensor,
    mask: Tensor,
    *,
    eta_orig: float,
    eta_masked: float,
    **aggregate_kwargs,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Double entropy loss term eta1 H(orig) + eta2 H(masked) (PAPO Eq. 2, sign per the code).

    Args:
        log_probs: ``(batch, time)`` original-image log-probs.
        masked_log_probs: ``(batch, time)`` masked-image log-probs (detached by default, in which
            case the eta2 term carries no gradient, as in the official code, issue #20).
        mask: ``(batch, time)`` real tokens.
        eta_orig: eta1.
        eta_masked: eta2.

    Returns:
        ``(loss_term, {"entropy_orig", "entropy_masked"})``.
    """
    entropy_orig = sequence_nll_entropy(log_probs, mask, **aggregate_kwargs)
    entropy_masked = sequence_nll_entropy(masked_log_probs, mask, **aggregate_kwargs)
    term = eta_orig * entropy_orig + eta_masked * entropy_masked
    return term, {"entropy_orig": entropy_orig, "entropy_masked": entropy_masked}


# --------------------------------------------------------------------------------------------
# Step 5: optional annealing of gamma
# --------------------------------------------------------------------------------------------


def annealed_coefficient(
    step: int, total_steps: int, *, start: float, end: float, annealing_ratio: float = 1.0
) -> float:
    """Linear schedule from ``start`` to ``end`` over the first ``annealing_ratio * total_steps`` steps.

    PAPO's ``kl_prcp_schedule: annealing``; afterwards the value stays at ``end``.
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if not 0.0 < annealing_ratio <= 1.0:
        raise ValueError(f"annealing_ratio must be in (0, 1], got {annealing_ratio}")
    span = annealing_ratio * total_steps
    fraction = min(max(step, 0) / span, 1.0)
    return start + (end - start) * fraction


def papo_extra_loss(
    log_probs: Tensor,
    masked_log_probs: Tensor,
    mask: Tensor,
    *,
    gamma: float,
    eta_orig: float,
    eta_masked: float,
    aggregation: str = "token-mean",
    **aggregate_kwargs,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The terms PAPO adds to the policy loss: -gamma KL_prcp + eta1 H(orig) + eta2 H(masked).

    Args:
        log_probs: ``(batch, time)`` original-image log-probs (with grad).
        masked_log_probs: ``(batch, time)`` masked-image log-probs.
        mask: ``(batch, time)`` real tokens.
        gamma: perception KL coefficient (paper 0.02 PAPO-G, 0.01 PAPO-D).
        eta_orig, eta_masked: double-entropy coefficients (0.05 7B PAPO-G, 0.03 PAPO-D).
        aggregation: the policy loss's aggregation mode (used for KL_prcp).

    Returns:
        ``(loss_term, metrics)`` with metrics ``papo/kl_prcp``, ``papo/entropy_orig``,
        ``papo/entropy_masked`` (detached).
    """
    kl_prcp, _ = perception_kl(log_probs, masked_log_probs, mask, aggregation=aggregation, **aggregate_kwargs)
    entropy_term, entropies = double_entropy(
        log_probs,
        masked_log_probs,
        mask,
        eta_orig=eta_orig,
        eta_masked=eta_masked,
        global_tokens=aggregate_kwargs.get("global_tokens"),
    )
    term = -gamma * kl_prcp + entropy_term
    metrics = {
        "papo/kl_prcp": kl_prcp.detach(),
        "papo/entropy_orig": entropies["entropy_orig"].detach(),
        "papo/entropy_masked": entropies["entropy_masked"].detach(),
    }
    return term, metrics
