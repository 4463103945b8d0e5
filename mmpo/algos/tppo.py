"""T-PPO: Truncated Proximal Policy Optimization (arXiv 2506.15050).

No official code was found (docs/algorithm_sources.md section 14, T-PPO); the mechanism follows the paper's abstract:

- windowed generation: each training step extends every response by at most ``window_len`` tokens. New
  prompts start G responses; responses still unfinished at the end of the window are carried to the next
  step (module state, saved in checkpoints) and continue from ``prompt + tokens so far``;
- the policy is updated on the window's tokens with extended GAE (estimator ``tppo``): a completed response
  ends in its terminal reward, a truncated one bootstraps the critic's value of the state after its last
  token (:func:`~mmpo.core.advantages_truncated.truncated_gae`);
- the critic is trained only on completed sequences (value targets = GAE returns, MSE).

The critic is PPO's value model (:class:`~mmpo.algos.ppo.TokenValueModel`, ``critic``: a separate backbone with
a scalar head, loaded from ``critic.path`` or the policy, its own learning rate and weight decay), as the paper
trains a separate value model. ``critic: null`` selects the cheaper earlier form: a linear value head on the
policy's detached final hidden states.

Simplifications, each UNVERIFIED against the paper: a completed response that spanned several windows trains
the critic on its last window only (earlier windows were updated at earlier steps); window length, gamma and
lambda defaults are not the paper's (gamma = lam = 1.0 are verl's PPO defaults).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from mmpo.algos.config import refuse_rollout_correction, require
from mmpo.algos.grpo import GRPOModule
from mmpo.algos.ppo import TokenValueModel, shard_value_model, states_from_last_prompt_token
from mmpo.training.config import AdvantageConfig, ValueModelConfig, as_config
from mmpo.training.state_hooks import CheckpointedState
from mmpo.core import LossParts, compute_advantages_with_metrics
from mmpo.training.optim import make_optimizer, max_steps_or_none
from mmpo.vlm.continuation import ended, extend_prompts, generate_from_inputs
from mmpo.vlm.processing import encode_prompts
from mmpo.vlm.rollout import Rollout, concat_rollouts


def _row_to_state(row: Mapping[str, Any]) -> dict[str, Any]:
    """A dataset row as tensors and plain values (checkpoints load with ``weights_only=True``)."""
    out = {k: v for k, v in row.items() if k != "images"}
    out["images"] = [{"pixels": torch.from_numpy(np.array(im)), "mode": im.mode} for im in row.get("images") or []]
    return out


def _row_from_state(state: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(state)
    out["images"] = [Image.fromarray(im["pixels"].numpy(), mode=im["mode"]) for im in state["images"]]
    return out


class InflightResponses:
    """Responses still running at the end of a step, continued by the next (checkpointed as ``tppo_inflight``):
    ``items`` are ``{"row": dataset row, "tokens": LongTensor generated so far}``."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def state_dict(self) -> list[dict[str, Any]]:
        return [{"row": _row_to_state(item["row"]), "tokens": item["tokens"]} for item in self.items]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        self.items = [{"row": _row_from_state(item["row"]), "tokens": item["tokens"]} for item in state]


class TPPOModule(CheckpointedState, GRPOModule):
    """PPO with truncated (windowed) rollouts, extended GAE and a critic trained on completed sequences.

    ``max_new_tokens`` is the full response budget; each step generates at most ``window_len`` tokens of
    every response.

    Args:
        model_path: saved HF model directory.
        window_len: tokens generated per response per step (UNVERIFIED; the paper's window length is not known here).
        gamma: discount of the extended GAE.
        lam: GAE lambda.
        critic: the value model (:class:`~mmpo.training.config.ValueModelConfig`; T-PPO reads ``path``, ``lr``,
            ``weight_decay`` and ``head_init_std``); None = a linear head on the policy's detached final hidden
            states (zero-initialised, trained at ``value_lr``).
        value_lr: learning rate of the value head when ``critic`` is None (None = ``lr``).
        value_coef: coefficient of the critic's MSE loss.
        max_inflight: most unfinished responses carried to the next step (the oldest are kept); None = all.
        **kwargs: every :class:`GRPOModule` setting (``advantage`` is fixed to ``tppo``).
    """

    checkpointed_state = (("tppo_inflight", "inflight"),)
    config_groups = GRPOModule.config_groups + ("critic",)

    def __init__(
        self,
        model_path: str,
        *,
        advantage: AdvantageConfig = AdvantageConfig(name="tppo"),
        window_len: int = 16,
        gamma: float = 1.0,
        lam: float = 1.0,
        critic: ValueModelConfig | None = ValueModelConfig(),
        value_lr: float | None = None,
        value_coef: float = 1.0,
        max_inflight: int | None = None,
        **kwargs: Any,
    ) -> None:
        advantage = as_config(advantage, AdvantageConfig(name="tppo"))
        require(advantage.name == "tppo", "TPPOModule's advantage is 'tppo'")
        self.critic = None if critic is None else as_config(critic, ValueModelConfig())
        super().__init__(model_path, advantage=advantage, **kwargs)
        self.value_model: TokenValueModel | None = None
        self.value_head: torch.nn.Linear | None = None
        if self.critic is not None:
            self.value_model = TokenValueModel.load(
                self.critic.path or model_path, dtype=getattr(torch, self.hparams.dtype),
                head_init_std=self.critic.head_init_std, seed=self.hparams.seed)
            self.value_model.train()
        else:
            hidden = self.model.get_output_embeddings().weight.shape[1]
            self.value_head = torch.nn.Linear(hidden, 1)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
        self.inflight = InflightResponses()

    def _validate_settings(self) -> None:
        super()._validate_settings()
        h = self.hparams
        require(1 <= h.window_len <= self.sampling.max_new_tokens,
                f"window_len must be in [1, max_new_tokens={self.sampling.max_new_tokens}], got {h.window_len}")
        require(0 < h.gamma <= 1, f"gamma must be in (0, 1], got {h.gamma}")
        require(0 <= h.lam <= 1, f"lam must be in [0, 1], got {h.lam}")
        require(h.value_lr is None or h.value_lr > 0, f"value_lr must be > 0 or None, got {h.value_lr}")
        c = self.critic
        if c is not None:
            require(h.value_lr is None, "T-PPO: set the critic's learning rate as critic.lr (value_lr is for critic: null)")
            require(not c.frozen and c.warmup_steps == 0 and c.lora_rank == 0,
                    "T-PPO's critic reads path, lr, weight_decay and head_init_std only (frozen, warmup_steps and "
                    "lora_rank are PPO's)")
        require(h.value_coef >= 0, f"value_coef must be >= 0, got {h.value_coef}")
        require(h.max_inflight is None or h.max_inflight >= 0, f"max_inflight must be >= 0 or None, got {h.max_inflight}")
        require(self.optim.minibatch_size is None,
                "T-PPO's rollout size varies (carried responses): set minibatch_size null")
        require(not self.advantage.dynamic_sampling,
                "dynamic_sampling does not apply to T-PPO (critic baseline, no groups)")
        refuse_rollout_correction(self.rollout_correction)

    def configure_optimizers(self) -> dict[str, Any]:
        if self.value_model is not None:
            critic = {"params": list(self.value_model.parameters()), "lr": self.critic.lr,
                      "weight_decay": self.critic.weight_decay}
        else:
            critic = {"params": list(self.value_head.parameters()), "lr": self.hparams.value_lr or self.optim.lr,
                      "weight_decay": 0.0}
        groups = [{"params": list(self.model.parameters())}, critic]
        return make_optimizer(groups, lr=self.optim.lr, weight_decay=self.optim.weight_decay, betas=self.optim.betas,
                              warmup_steps=self.optim.warmup_steps, schedule=self.optim.lr_schedule,
                              total_steps=max_steps_or_none(self))

    # ------------------------------------------------------------------ rollout

    def build_rollout(self, rows: Sequence[Mapping[str, Any]]) -> Rollout:
        """This step's window: G fresh responses per new row, plus one window of every carried response.
        ``extras``: ``tppo_completed`` (N,) ended by EOS or the full budget; ``tppo_prefix_len`` (N,)."""
        h = self.hparams
        engine = self.engine
        fresh = engine.generate(rows, num_samples=self.sampling.num_generations,
                                max_new_tokens=min(h.window_len, self.sampling.max_new_tokens),
                                temperature=self.sampling.temperature, top_p=self.sampling.top_p)
        fresh.extras = {"tppo_prefix_len": torch.zeros(len(fresh), dtype=torch.long)}  # the keys both parts share
        fresh.extras["tppo_completed"] = self._completed(fresh)
        parts = [fresh]
        carried = self.inflight.items
        if carried:
            prompts = encode_prompts(self.processor, [c["row"] for c in carried], system_prompt=engine.system_prompt,
                                     max_prompt_length=engine.max_prompt_length)
            prefix = torch.nn.utils.rnn.pad_sequence([c["tokens"] for c in carried], batch_first=True,
                                                     padding_value=engine.pad_token_id)
            prefix_mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(c["tokens"]) for c in carried], batch_first=True)
            # one generate call for all: the shortest response's budget, each row cut at its own below
            budget = min(h.window_len, self.sampling.max_new_tokens - min(len(c["tokens"]) for c in carried))
            more = generate_from_inputs(engine, [c["row"] for c in carried],
                                        extend_prompts(prompts, prefix, prefix_mask, pad_token_id=engine.pad_token_id),
                                        max_new_tokens=max(budget, 1), temperature=self.sampling.temperature,
                                        top_p=self.sampling.top_p)
            # each carried response keeps its own budget; the reward reads the whole response so far
            for i, c in enumerate(carried):
                more.completion_mask[i, max(0, self.sampling.max_new_tokens - len(c["tokens"])):] = 0
            more.completion_ids = more.completion_ids.masked_fill(more.completion_mask == 0, engine.pad_token_id)
            heads = self.processor.batch_decode([c["tokens"] for c in carried], skip_special_tokens=True)
            more.texts = [head + text for head, text in
                          zip(heads, self.processor.batch_decode(more.completion_ids, skip_special_tokens=True))]
            more.extras["tppo_prefix_len"] = torch.tensor([len(c["tokens"]) for c in carried])
            more.extras["tppo_completed"] = self._completed(more)
            parts.append(more)
        # (before concatenation: its right-padding would read as an ended row)
        rollout = concat_rollouts(parts) if len(parts) > 1 else fresh
        completed = rollout.extras["tppo_completed"]
        # responses still running continue next step, from everything generated so far
        previous = [torch.empty(0, dtype=torch.long)] * len(fresh) + [c["tokens"] for c in carried]
        inflight = [{"row": rollout.rows[i],
                     "tokens": torch.cat([previous[i], rollout.completion_ids[i][rollout.completion_mask[i] > 0]])}
                    for i in range(len(rollout)) if not bool(completed[i])]
        self.inflight.items = inflight if h.max_inflight is None else inflight[: h.max_inflight]
        return rollout

    def _completed(self, part: Rollout) -> Tensor:
        """``(N,)`` bool: the response ended in this window (EOS / vision token) or used its full budget."""
        total = part.extras["tppo_prefix_len"] + part.completion_mask.sum(-1)
        return ended(part, self.engine.eos_token_id) | (total >= self.sampling.max_new_tokens)

    # ------------------------------------------------------------------ critic

    def state_values(self, rollout: Rollout) -> Tensor:
        """``(N, T + 1)`` V(s_t) before each completion token t and, at column l, after the last one.

        The value model's (:meth:`TokenValueModel.state_values`); with ``critic: null`` the value head on the
        policy's final hidden state at the position that predicts the next token, detached (the critic does not
        train the policy)."""
        if self.value_model is not None:
            return self.value_model.state_values(rollout)
        with torch.no_grad():
            states = states_from_last_prompt_token(self.model, rollout).float()  # (N, T + 1, H)
        return self.value_head(states).squeeze(-1)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.value_model is not None:
            self.value_model.to(self.device)

    def configure_model(self) -> None:
        super().configure_model()
        if self.value_model is not None:
            shard_value_model(self, self.value_model, frozen=False)

    def compute_advantages(self, rewards: Tensor, group_ids: Tensor, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        h = self.hparams
        values = []
        with torch.no_grad():
            for index in torch.arange(len(rollout)).split(self.optim.micro_batch_size or len(rollout)):
                values.append(self.state_values(rollout.select(index).to(self.device)).cpu())
        values = torch.cat(values).to(rewards)
        mask = rollout.completion_mask.to(rewards)
        lengths = mask.sum(-1).long()
        bootstrap = values.gather(1, lengths.unsqueeze(1)).squeeze(1)
        completed = rollout.extras["tppo_completed"].to(rewards.device)
        advantages, metrics = compute_advantages_with_metrics(
            "tppo", rewards, torch.zeros_like(group_ids), mask=mask, values=values[:, :-1] * mask,
            completed=completed, bootstrap_values=bootstrap, gamma=h.gamma, lam=h.lam)
        # critic targets: the GAE returns of completed rows only
        rollout.extras["tppo_returns"] = advantages + values[:, :-1] * mask
        rollout.extras["tppo_value_mask"] = mask * completed.to(rewards).unsqueeze(1)
        metrics["tppo/completed_frac"] = float(completed.float().mean())
        metrics["tppo/carried"] = float((rollout.extras["tppo_prefix_len"] > 0).sum())
        metrics["tppo/inflight"] = float(len(self.inflight.items))
        metrics["tppo/value_mean"] = float(values[:, :-1][mask > 0].mean()) if bool((mask > 0).any()) else 0.0
        return advantages, metrics

    def extra_loss_terms(self, minibatch: Rollout, outputs: Mapping[str, Any]) -> tuple[LossParts, dict[str, Any]]:
        """The critic's MSE on completed rows, 0.5 (V - return)^2, normalised like the policy loss."""
        value_mask = minibatch.extras["tppo_value_mask"].to(outputs["mask"])
        values = self.state_values(minibatch)[:, :-1]
        error = 0.5 * (values - minibatch.extras["tppo_returns"].to(values)) ** 2
        parts = LossParts().add("value", outputs["aggregation"](error, value_mask), self.hparams.value_coef)
        return parts, {}
