"""INPO (Iterative Nash Policy Optimization, arXiv 2407.00617) for vision-language models, online.

INPO treats alignment as a two-player game and runs online mirror descent by self-play: each
iteration t samples response pairs from the current iterate pi_t, labels them with a preference
oracle (no Bradley-Terry reward model is assumed), and fits pi_{t+1} with the square loss of
``mmpo.core.inpo_loss``, anchored at pi_t (weight 1 - eta tau) and at pi_ref (weight eta tau).

One training step, top to bottom (``training_step``):

1. sample       ``num_generations`` completions per prompt from the anchor pi_t (the previous
                iterate; a frozen copy of the policy, refreshed every ``iteration_steps`` steps)
2. label        the preference oracle ranks each prompt's completions: by default the reward
                functions (``reward_weights``; synthetic tasks: correctness) and then brevity
                (fewer tokens wins a tie), the best and the worst form the pair; or a pairwise
                judge of your own (``judge: file.py:fn``, TRL's ``judge(prompts, completions)``
                returning 0 / 1 for the preferred one, -1 for no preference). Ties give no pair.
3. log-probs    the pair under the policy (with grad), pi_ref (the initial policy) and pi_t (no grad)
4. loss         ``inpo_loss`` (eta, tau); AdamW step (automatic optimisation, non-finite guard)
5. iterate      after every ``iteration_steps`` optimizer steps the anchor becomes the current policy.

The paper's outer loop (sample a whole preference set from pi_t, then minimise L_t to convergence)
is the case of a large ``iteration_steps``; ``iteration_steps: 1`` samples every batch from the
policy being trained.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from mmpo.algos.config import greedy_validation_metrics, require, step_seed
from mmpo.algos.dpo import summed_log_probs
from mmpo.algos.vlm_base import VLMPolicyModule
from mmpo.training.config import OptimConfig, RewardConfig, SamplingConfig, as_config
from mmpo.core import check_inpo_settings, inpo_loss
from mmpo.vlm.factory import make_reference_model
from mmpo.vlm.fsdp import is_sharded
from mmpo.vlm.rollout import HFGenerateEngine, Rollout

log = logging.getLogger(__name__)

#: the preference oracle's reward for the synthetic tasks: correctness (brevity breaks ties)
DEFAULT_ORACLE_REWARDS = {"accuracy": 1.0}


def select_pairs(rewards: Tensor, lengths: Tensor, group_ids: Tensor, *, brevity: bool = True) -> list[tuple[int, int]]:
    """(chosen, rejected) positions per group: the best and the worst completion by (reward, then
    fewer tokens when ``brevity``); a group whose best and worst rank equal gives no pair.

    Args:
        rewards: (N,) oracle rewards. lengths: (N,) completion tokens. group_ids: (N,) prompt of each.
    """
    pairs = []
    for group in dict.fromkeys(group_ids.tolist()):  # groups in order of appearance
        members = [i for i, g in enumerate(group_ids.tolist()) if g == group]
        keys = {i: (float(rewards[i]), -float(lengths[i]) if brevity else 0.0) for i in members}
        best = max(members, key=lambda i: keys[i])  # first of the equal best
        worst = min(members, key=lambda i: keys[i])  # first of the equal worst
        if keys[best] != keys[worst]:
            pairs.append((best, worst))
    return pairs


def load_judge(spec: str) -> Callable[..., Sequence[int]]:
    """A pairwise judge from ``path/to/file.py:fn`` or ``package.module:fn`` (the reward loader's rules)."""
    from mmpo.rewards.user import _function_of, _import_module, _load_file, parse_reward_spec

    parsed = parse_reward_spec(spec)
    module = _load_file(parsed) if parsed.file is not None else _import_module(parsed)
    return _function_of(parsed, module)


def judge_pairs(judge: Callable[..., Sequence[int]], rollout: Rollout) -> list[tuple[int, int]]:
    """(chosen, rejected) per prompt from a pairwise judge over each prompt's two completions.

    TRL's pairwise-judge convention: ``judge(prompts, completions)`` with ``completions`` a list of
    ``[a, b]``, returning per prompt 0 (a preferred), 1 (b preferred) or -1 (no preference: no pair).
    """
    positions: dict[int, list[int]] = {}
    for i, group in enumerate(rollout.group_ids.tolist()):
        positions.setdefault(group, []).append(i)
    groups = list(positions)
    if any(len(positions[g]) != 2 for g in groups):
        raise ValueError("a pairwise judge compares two completions per prompt: set num_generations: 2")
    prompts = [rollout.rows[positions[g][0]]["problem"] for g in groups]
    verdicts = list(judge(prompts, [[rollout.texts[a], rollout.texts[b]] for a, b in (positions[g] for g in groups)]))
    if len(verdicts) != len(groups) or any(v not in (0, 1, -1) for v in verdicts):
        raise ValueError(f"the judge must return one of 0, 1, -1 per prompt ({len(groups)} prompts), got {verdicts!r}")
    return [(positions[g][v], positions[g][1 - v]) for g, v in zip(groups, verdicts) if v != -1]


class INPOModule(VLMPolicyModule):
    """Online INPO for a Qwen-VL policy (self-play pairs, a preference oracle, the previous iterate as anchor).

    Args:
        model_path: saved HF model directory (an SFT output or a real checkpoint); also pi_ref.
        eta: INPO's mirror-descent learning rate (the pair's anchored log-ratio margin is regressed onto eta / 2).
        tau: KL regularisation towards pi_ref (the loss weights pi_ref by eta tau and pi_t by 1 - eta tau; eta tau <= 1).
        iteration_steps: optimizer steps per INPO iteration: the anchor pi_t (sampler and loss anchor) is
            replaced by the current policy after this many steps.
        sampling: rollout sampling (:class:`~mmpo.training.config.SamplingConfig`); ``num_generations`` >= 2: the
            oracle's best and worst form the pair; ``val_max_new_tokens`` is the greedy validation length.
        optim: AdamW and its schedule (:class:`~mmpo.training.config.OptimConfig`: lr, weight_decay, warmup_steps,
            lr_schedule).
        rewards: the oracle's reward functions (:class:`~mmpo.training.config.RewardConfig`: ``weights``, registered
            names or ``file.py:fn``, None = accuracy 1.0; ``timeout_s`` per call, None = inline, no deadline).
        brevity: break reward ties by length (fewer completion tokens preferred).
        judge: a pairwise judge ``file.py:fn`` / ``module:fn`` (TRL's ``judge(prompts, completions)`` -> 0 / 1 / -1)
            used instead of the reward ranking; needs num_generations 2.
        save_hf_on_checkpoint: also write HF weights to output_dir whenever a Lightning checkpoint is saved.
        seed: seeds sampling (per step and rank).
        **kwargs: the settings every VLM module shares (:class:`~mmpo.algos.vlm_base.VLMPolicyModule`).
    """

    config_groups = ("sampling", "optim", "rewards")

    # memory (mmpo estimate): pi_ref and the anchor pi_t are two frozen copies of the policy, in its dtype
    FROZEN_POLICY_COPIES = 2
    # and the model that samples is pi_t (under FSDP2 gathered whole for generate, in its dtype)
    SAMPLES_FROM_FROZEN_COPY = True

    def __init__(
        self,
        model_path: str,
        eta: float = 2.0,
        tau: float = 0.1,
        iteration_steps: int = 1,
        sampling: SamplingConfig = SamplingConfig(),
        optim: OptimConfig = OptimConfig(),
        rewards: RewardConfig = RewardConfig(),
        brevity: bool = True,
        judge: str | None = None,
        save_hf_on_checkpoint: bool = False,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        self.sampling = as_config(sampling, SamplingConfig())  # set before the base class validates them
        self.rewards = as_config(rewards, RewardConfig())
        super().__init__(model_path, optim=optim, save_hf_on_checkpoint=save_hf_on_checkpoint, **kwargs)
        weights = self.rewards.weights
        self.reward_weights = dict(weights) if weights is not None else dict(DEFAULT_ORACLE_REWARDS)
        self._judge = load_judge(judge) if judge is not None else None
        # kept out of the module tree (not trained; pi_ref is rebuilt from model_path, pi_t is checkpointed)
        self._frozen = {"reference": make_reference_model(self.model, 1.0), "anchor": make_reference_model(self.model, 1.0)}
        self.anchor_engine = HFGenerateEngine(self._frozen["anchor"], self.processor, system_prompt=self.system_prompt,
                                              max_prompt_length=self.hparams.max_prompt_length)

    def _validate_settings(self) -> None:
        h = self.hparams
        check_inpo_settings(h.eta, h.tau)
        require(h.iteration_steps >= 1, f"iteration_steps must be >= 1, got {h.iteration_steps}")
        require(self.sampling.num_generations >= 2,
                f"num_generations must be >= 2 (a pair per prompt), got {self.sampling.num_generations}")
        require(h.judge is None or self.sampling.num_generations == 2,
                "a pairwise judge compares two completions: num_generations must be 2, "
                f"got {self.sampling.num_generations}")
        from mmpo.rewards.user import validate_reward_weights

        validate_reward_weights(self.rewards.weights, models=self.rewards.models)

    @property
    def reference_model(self) -> torch.nn.Module:
        """pi_ref: the frozen initial policy."""
        return self._frozen["reference"]

    @property
    def anchor_model(self) -> torch.nn.Module:
        """pi_t: the previous iterate (samples the pairs and anchors the loss)."""
        return self._frozen["anchor"]

    def _models_to_shard(self) -> list[torch.nn.Module]:
        # FSDP2: pi_ref and pi_t are sharded as the policy (each rank holds 1 / world of each)
        return [self.reference_model, self.anchor_model]

    def on_fit_start(self) -> None:
        for model in self._frozen.values():
            model.to(self.device)

    # ------------------------------------------------------------------ the step

    def preference_pairs(self, rollout: Rollout) -> tuple[list[tuple[int, int]], dict[str, float]]:
        """The oracle's (chosen, rejected) positions in ``rollout`` and oracle metrics."""
        if self._judge is not None:
            return judge_pairs(self._judge, rollout), {}
        from mmpo.rewards import compute_rewards

        rewards, _, metrics = compute_rewards(self.reward_weights, rollout.texts, rollout.rows,
                                              timeout_s=self.rewards.timeout_s)
        lengths = rollout.completion_mask.sum(-1)
        metrics["rewards/total/mean"] = float(rewards.mean())
        return select_pairs(rewards, lengths, rollout.group_ids, brevity=self.hparams.brevity), metrics

    def _pair_log_probs(self, model: torch.nn.Module, pairs: Rollout) -> Tensor:
        return summed_log_probs(model, pairs.prompt_inputs, pairs.completion_ids, pairs.completion_mask,
                                chunk_size=self.hparams.logprob_chunk_size, temperature=self.sampling.temperature)

    def training_step(self, batch: Sequence[Mapping[str, Any]], batch_idx: int) -> Tensor | None:
        h = self.hparams
        rows = list(batch)
        # 1. sample from pi_t, seeded by (seed, step, rank) without touching the global RNG streams; under
        # FSDP2 the engine samples on pi_t's gathered full weights (no collective while decoding)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(step_seed(h.seed, self.trainer.global_step, self.global_rank))
            sampling = self.sampling
            rollout = self.anchor_engine.generate(rows, num_samples=sampling.num_generations,
                                                  max_new_tokens=sampling.max_new_tokens,
                                                  temperature=sampling.temperature, top_p=sampling.top_p,
                                                  do_sample=True)
        # 2. the oracle's pairs
        pairs, metrics = self.preference_pairs(rollout)
        metrics["pairs/count"] = float(len(pairs))
        metrics["response/length_mean"] = float(rollout.completion_mask.sum(-1).float().mean())
        # the skip is decided over every process: one that skips while another trains would leave the
        # other's gradient collectives (DDP all-reduce, FSDP2 all-gather / reduce-scatter) unanswered
        if not self._any_process_has_pairs(bool(pairs)):  # every prompt tied: no update (no optimizer step)
            log.warning("step %s: the oracle preferred no completion of any prompt; batch skipped", self.global_step)
            self._log_step(metrics, len(rows))
            return None
        # a process without a pair of its own runs a stand-in pair (its first two completions) with weight
        # 0: the same forwards and backward as the others, a zero gradient
        weight = 1.0 if pairs else 0.0
        index = [c for c, _ in pairs] + [r for _, r in pairs] if pairs else [0, 1]
        both = rollout.select(index).to(self.device)
        # 3. log-probs: policy (grad), pi_ref and pi_t (no grad)
        policy = self._pair_log_probs(self.model, both)
        with torch.no_grad():
            reference = self._pair_log_probs(self.reference_model, both)
            anchor = self._pair_log_probs(self.anchor_model, both)
        # 4. the INPO loss
        loss, loss_metrics = inpo_loss(*policy.chunk(2), *reference.chunk(2), *anchor.chunk(2), eta=h.eta, tau=h.tau)
        loss = loss * weight
        if pairs:
            metrics.update(loss_metrics)
        self._log_step(metrics, len(rows))
        return loss

    def _log_step(self, metrics: Mapping[str, float], batch_size: int) -> None:
        """One step's metrics, the progress-bar ones always with the same arguments: Lightning refuses a key
        logged with other arguments later in the epoch (a skipped step's, then a trained step's)."""
        shown = {"rewards/accuracies", "rewards/total/mean"}
        self.log_dict({k: v for k, v in metrics.items() if k in shown}, on_step=True, prog_bar=True, batch_size=batch_size)
        self.log_dict({k: v for k, v in metrics.items() if k not in shown}, on_step=True, batch_size=batch_size)

    def _any_process_has_pairs(self, has_pairs: bool) -> bool:
        strategy = self._trainer.strategy if self._trainer is not None else None
        if strategy is None:
            return has_pairs
        return bool(strategy.reduce_boolean_decision(has_pairs, all=False))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._refresh_anchor_if_due()

    def _refresh_anchor_if_due(self) -> None:
        # 5. a new iteration: pi_t <- the current policy (global_step counts optimizer steps taken); once per step
        step = self.trainer.global_step
        if step > 0 and step % self.hparams.iteration_steps == 0 and step != getattr(self, "_anchor_step", None):
            # under FSDP2 both are sharded alike: each rank copies its own shards
            self.anchor_model.load_state_dict(self.model.state_dict())
            self._anchor_step = step

    def validation_step(self, batch: Sequence[Mapping[str, Any]], batch_idx: int) -> None:
        """Greedy ``val/accuracy`` and ``val/format`` of the policy on held-out prompts."""
        metrics = greedy_validation_metrics(self.engine, list(batch), max_new_tokens=self.sampling.val_max_new_tokens
                                            or self.sampling.max_new_tokens,
                                            timeout_s=self.rewards.timeout_s)
        self.log_dict(metrics, batch_size=len(batch), sync_dist=True, prog_bar=True)

    # ------------------------------------------------------------------ checkpoints

    def sharded_checkpoint_tensors(self) -> dict[str, Tensor]:
        """Under FSDP2: pi_t's sharded weights, which ``FSDP2Strategy`` saves and loads per rank."""
        if not is_sharded(self.anchor_model):
            return {}
        return dict(self.anchor_model.state_dict())

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # pi_t is not the saved policy in the middle of an iteration; a resumed run needs it (pi_ref is
        # rebuilt from model_path). Sharded: FSDP2Strategy carries it (sharded_checkpoint_tensors).
        # ModelCheckpoint saves in its on_train_batch_end, which Lightning calls before this module's: a
        # checkpoint at the end of an iteration would hold the old pi_t, so the refresh due now comes first
        if self._trainer is not None:
            self._refresh_anchor_if_due()
        if not is_sharded(self.anchor_model):
            checkpoint["mmpo_inpo_anchor"] = {k: v.detach().cpu() for k, v in self.anchor_model.state_dict().items()}
        checkpoint["mmpo_inpo_anchor_step"] = getattr(self, "_anchor_step", None)
        super().on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "mmpo_inpo_anchor" in checkpoint:
            self.anchor_model.load_state_dict(checkpoint["mmpo_inpo_anchor"])
            self._anchor_step = checkpoint.get("mmpo_inpo_anchor_step")
        super().on_load_checkpoint(checkpoint)
