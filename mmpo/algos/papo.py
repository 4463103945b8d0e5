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
``docs/algorithm_sources.md`` section 1.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from mmpo.algos.config import require
from mmpo.algos.grpo import GRPOModule
from mmpo.core import LossParts
from mmpo.core.aggregate import aggregate
from mmpo.core.kl import kl_penalty
from mmpo.vlm.processing import encode_prompts, repeat_rows
from mmpo.vlm.rollout import Rollout

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


def papo_loss_parts(
    log_probs: Tensor,
    masked_log_probs: Tensor,
    mask: Tensor,
    *,
    gamma: float,
    eta_orig: float,
    eta_masked: float,
    aggregation: str = "token-mean",
    **aggregate_kwargs,
) -> tuple[LossParts, dict[str, Tensor]]:
    """The terms PAPO adds to the policy loss, as named parts: -gamma KL_prcp + eta1 H(orig) + eta2 H(masked).

    Args:
        log_probs: ``(batch, time)`` original-image log-probs (with grad).
        masked_log_probs: ``(batch, time)`` masked-image log-probs.
        mask: ``(batch, time)`` real tokens.
        gamma: perception KL coefficient (paper 0.02 PAPO-G, 0.01 PAPO-D).
        eta_orig, eta_masked: double-entropy coefficients (0.05 7B PAPO-G, 0.03 PAPO-D).
        aggregation: the policy loss's aggregation mode (used for KL_prcp).
        **aggregate_kwargs: its global normalisers (``global_tokens``, ``global_seqs``, ``norm_len``).

    Returns:
        ``(parts, metrics)``: :class:`~mmpo.core.LossParts` ``papo/kl_prcp`` (coefficient -gamma)
        and ``papo/double_entropy`` (eta1 H(orig) + eta2 H(masked)), whose ``total()`` is the
        term; metrics ``papo/kl_prcp``, ``papo/entropy_orig``, ``papo/entropy_masked`` (detached).
    """
    kl_prcp, _ = perception_kl(log_probs, masked_log_probs, mask, aggregation=aggregation, **aggregate_kwargs)
    # the double-entropy regulariser is one term of PAPO's Eq. 2 (token means, global token count)
    entropy_term, entropies = double_entropy(log_probs, masked_log_probs, mask, eta_orig=eta_orig,
                                             eta_masked=eta_masked, global_tokens=aggregate_kwargs.get("global_tokens"))
    parts = LossParts().add("papo/kl_prcp", kl_prcp, -gamma).add("papo/double_entropy", entropy_term)
    metrics = {"papo/kl_prcp": kl_prcp.detach(), **{f"papo/{k}": v.detach() for k, v in entropies.items()}}
    return parts, metrics


def papo_extra_loss(
    log_probs: Tensor, masked_log_probs: Tensor, mask: Tensor, **settings: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`papo_loss_parts` summed: ``(-gamma KL_prcp + eta1 H(orig) + eta2 H(masked), metrics)``."""
    parts, metrics = papo_loss_parts(log_probs, masked_log_probs, mask, **settings)
    return parts.total(), metrics


# --------------------------------------------------------------------------------------------
# The Lightning module: GRPO (PAPO-G) or DAPO settings (PAPO-D) plus the steps above
# --------------------------------------------------------------------------------------------

MASKED_LOG_PROBS = "papo_masked_log_probs"
MASK_STEP = "papo_mask_step"


class PAPOModule(GRPOModule):
    """PAPO (arXiv 2507.06448) on top of :class:`~mmpo.algos.grpo.GRPOModule`.

    PAPO-G uses the GRPO settings (beta 0.01, clip 0.2/0.3); PAPO-D the DAPO ones (beta 0,
    clip_high 0.28, dynamic_sampling). See ``configs/vlm/papo_*.yaml``.

    Args:
        model_path: saved HF model directory.
        gamma: coefficient of the perception KL, subtracted from the loss (paper: 0.02 PAPO-G,
            0.01 PAPO-D / no reference KL; 0.04 collapses).
        eta_orig: eta1, coefficient of the original-image entropy (NLL) term (0.05 for 7B PAPO-G,
            0.03 PAPO-D, 0 = off as for 3B PAPO-G).
        eta_masked: eta2, coefficient of the masked-image entropy (NLL) term.
        mask_prob: probability that a 14 x 14 cell is blackened (paper 0.6).
        mask_cell_size: cell side in pixels (paper 14, the ViT patch size).
        masked_with_grad: recompute the masked-image log-probs with gradient in every
            micro-batch (official ``RECOMPUTE_AUG_LOG_PROBS``); default: once per step, no grad.
        gamma_end: anneal gamma linearly to this value (eta1/eta2 follow the same discount);
            None = constant gamma.
        gamma_annealing_ratio: fraction of ``trainer.max_steps`` over which gamma is annealed.
        **kwargs: every :class:`GRPOModule` setting.
    """

    def __init__(
        self,
        model_path: str,
        *,
        gamma: float = 0.02,
        eta_orig: float = 0.0,
        eta_masked: float = 0.0,
        mask_prob: float = 0.6,
        mask_cell_size: int = 14,
        masked_with_grad: bool = False,
        gamma_end: float | None = None,
        gamma_annealing_ratio: float = 1.0,
        **kwargs: Any,
    ) -> None:
        # settings are checked before the (slow) model load
        require(gamma >= 0, f"gamma must be >= 0, got {gamma}")
        require(eta_orig >= 0 and eta_masked >= 0, f"eta_orig/eta_masked must be >= 0, got {eta_orig}/{eta_masked}")
        require(0.0 <= mask_prob <= 1.0, f"mask_prob must be in [0, 1], got {mask_prob}")
        require(mask_cell_size >= 1, f"mask_cell_size must be >= 1, got {mask_cell_size}")
        require(0.0 < gamma_annealing_ratio <= 1.0, f"gamma_annealing_ratio must be in (0, 1], got {gamma_annealing_ratio}")
        super().__init__(model_path, **kwargs)

    # -- step 1: masked images, one mask per prompt (shared by its G rollouts) -----------------

    def masked_rows(self, rows: Sequence[Mapping[str, Any]], step: int) -> list[dict[str, Any]]:
        """Copies of ``rows`` whose images are randomly patch-blackened (seeded by seed, step, row id)."""
        h = self.hparams
        out = []
        for row in rows:
            seed = mask_seed(h.seed, step, str(row["id"]))
            images = [
                random_patch_blackening(image, cell_size=h.mask_cell_size, mask_prob=h.mask_prob, seed=seed + k)
                for k, image in enumerate(row.get("images") or [])
            ]
            out.append({**row, "images": images})
        return out

    def masked_prompt_inputs(self, rows: Sequence[Mapping[str, Any]], step: int):
        """Processor inputs of the masked rows (same tokens and ``image_grid_thw`` as the originals)."""
        return encode_prompts(
            self.processor, self.masked_rows(rows, step), system_prompt=self.engine.system_prompt,
            max_prompt_length=self.hparams.max_prompt_length,
        )

    # -- step 2: masked-image log-probs, once per step without gradient -------------------------

    def build_rollout(self, rows: Sequence[Mapping[str, Any]]) -> Rollout:
        rollout = super().build_rollout(rows)
        step = self.trainer.global_step if self._trainer is not None else 0
        rollout.extras[MASK_STEP] = step
        if self.hparams.masked_with_grad:
            return rollout
        masked_prompts = repeat_rows(self.masked_prompt_inputs(rows, step), self.sampling.num_generations)
        original_grid = rollout.prompt_inputs.get("image_grid_thw")
        if original_grid is not None and not torch.equal(original_grid, masked_prompts["image_grid_thw"]):
            raise RuntimeError("PAPO: the masked images produced a different image grid than the originals")
        masked = dataclasses.replace(rollout, prompt_inputs=masked_prompts).to(self.device)
        chunk = self.optim.micro_batch_size or self.optim.minibatch_size or len(masked)
        with torch.no_grad():  # rollout-time weights, no gradient (official compute_log_probs_aug)
            parts = [self.sequence_log_probs(self.model, masked.select(index))[0]
                     for index in torch.arange(len(masked)).split(chunk)]
        rollout.extras[MASKED_LOG_PROBS] = torch.cat(parts, 0).cpu()
        return rollout

    def _masked_log_probs(self, minibatch: Rollout) -> Tensor:
        if not self.hparams.masked_with_grad:
            return minibatch.extras[MASKED_LOG_PROBS].to(self.device)
        # recompute with gradient: re-create the same masks from (seed, step, row id)
        prompts = self.masked_prompt_inputs(minibatch.rows, minibatch.extras[MASK_STEP])
        masked = dataclasses.replace(minibatch, prompt_inputs=prompts).to(self.device)
        return self.sequence_log_probs(self.model, masked)[0]

    # -- steps 3-5: -gamma KL_prcp + eta1 H(orig) + eta2 H(masked), annealed ------------------

    def coefficients(self) -> tuple[float, float, float]:
        """(gamma, eta1, eta2) at the current step (annealed when ``gamma_end`` is set)."""
        h = self.hparams
        if h.gamma_end is None or self._trainer is None or self.trainer.max_steps <= 0 or h.gamma == 0:
            return h.gamma, h.eta_orig, h.eta_masked
        gamma = annealed_coefficient(self.trainer.global_step, self.trainer.max_steps, start=h.gamma,
                                     end=h.gamma_end, annealing_ratio=h.gamma_annealing_ratio)
        discount = gamma / h.gamma
        return gamma, h.eta_orig * discount, h.eta_masked * discount

    def extra_loss_terms(self, minibatch: Rollout, outputs: Mapping[str, Any]) -> tuple[LossParts, dict[str, Any]]:
        log_probs, mask = outputs["log_probs"], outputs["mask"]
        masked_log_probs = self._masked_log_probs(minibatch)
        gamma, eta_orig, eta_masked = self.coefficients()
        # the step's aggregation mode and global normalisers, exactly as the policy loss uses them
        agg = outputs["aggregation"]
        parts, _ = papo_loss_parts(log_probs, masked_log_probs, mask, gamma=gamma, eta_orig=eta_orig,
                                   eta_masked=eta_masked, aggregation=agg.mode, global_tokens=agg.global_tokens,
                                   global_seqs=agg.global_seqs, norm_len=agg.norm_len)
        # metrics: this micro-batch's token means (the trainer token-weights them across micro-batches)
        with torch.no_grad():
            kl_local, _ = perception_kl(log_probs.detach(), masked_log_probs.detach(), mask)
            metrics = {
                "papo/kl_prcp": float(kl_local),
                "papo/entropy_orig": float(sequence_nll_entropy(log_probs.detach(), mask)),
                "papo/entropy_masked": float(sequence_nll_entropy(masked_log_probs.detach(), mask)),
                "papo/gamma": gamma,
            }
        return parts, metrics
