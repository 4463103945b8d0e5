"""The TAPO testbed: multi-strategy problems (``strategy_mix``) and a weak start that reads thought templates.

- **Task** (:mod:`mmpo.data.synthetic.strategy_tasks`): ``Values: v1 ... vn. Find the key value.``; the family,
  told only by the count of values, fixes the procedure (4 values: the largest, 5: the smallest, 6: the last).
- **Weak start** (:func:`build_weak_start`): a tiny Qwen3 text LM fine-tuned here on a fixed skill: every
  reasoning action of TAPO's set carries one procedure (:data:`ACTION_PROCEDURES`: ``SA`` the largest, ``DC`` the
  smallest, ``OST`` the last, ``SRR`` the second, ``CoT`` the first value). With a thought template in its
  prompt it is trained to apply the procedure of the template's first action (with probability ``follow``, 1 by
  default; else it copies the first value); without one it copies the first value, except with probability
  ``explore`` (0.15) where it applies a procedure drawn uniformly (:func:`weak_start_procedure`). Its training data
  never pairs a family with a procedure, and the first value is never an answer, so unguided it is rarely right
  and whole groups are wrong. After the default 600 steps it has learnt the skill only in part: with its family's
  action as the template, 0.2-0.6 of its sampled answers are right (bench/RESULTS.md, "TAPO testbed").
- **What TAPO must find**: which action helps which family. ``mmpo tapo-library`` (the tree search over the
  actions, scored by this policy's reward) has to discover it, and retrieval must map a problem to its family's
  template by the complexity feature (the count of numbers = the family). Nothing here assigns templates.

:class:`GroupCountingGRPOModule` is plain GRPO that also logs ``tapo/all_wrong_group_frac`` with TAPO's rule
(:func:`mmpo.algos.tapo.tapo_metrics`), so both algorithms' all-wrong group shares are measured alike.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Sequence

import torch

from mmpo.algos.grpo import GRPOModule
from mmpo.algos.tapo import REASONING_ACTIONS, children, guided_problem, tapo_metrics
from mmpo.data.synthetic.strategy_tasks import FAMILIES, PROCEDURES, apply_procedure, strategy_problem

#: the weak start's skill: the procedure it applies when a template's first action is this one
ACTION_PROCEDURES: dict[str, str] = {"SA": "largest", "DC": "smallest", "OST": "last", "SRR": "second", "CoT": "first"}
DEFAULT_PROCEDURE = "first"
TASK = "strategy_mix"


def answer_text(value: int) -> str:
    """The answer with a space before the digit, so it is the same token as in the problem (``Ġ7``)."""
    return f"<answer> {value}</answer>"


def weak_start_procedure(actions: Sequence[str] | None, rng: random.Random, *, follow: float = 1.0,
                         explore: float = 0.15) -> str:
    """The procedure the weak start is trained to apply: with a template (``actions``), the first action's with
    probability ``follow``, else ``first``; without one, ``first``, except with probability ``explore`` a
    procedure drawn uniformly from all of them (in :data:`PROCEDURES` order)."""
    draw = rng.random()
    if actions:
        return ACTION_PROCEDURES[actions[0]] if draw < follow else DEFAULT_PROCEDURE
    if draw < explore:
        return rng.choice(list(PROCEDURES))
    return DEFAULT_PROCEDURE


def random_template(rng: random.Random, max_depth: int = 3) -> tuple[str, ...]:
    """A node of the TAPO action tree drawn at random: 1 to ``max_depth`` actions, no action twice in a row."""
    node: tuple[str, ...] = ()
    for _ in range(rng.randint(1, max_depth)):
        node = rng.choice(children(node, list(REASONING_ACTIONS)))
    return node


def sft_example(rng: random.Random, *, guided_share: float = 0.6, follow: float = 1.0,
                explore: float = 0.15) -> tuple[dict[str, Any], str]:
    """One (row, target) of the weak start's data: a random family's values, with a random template in the
    prompt with probability ``guided_share``; the target applies :func:`weak_start_procedure`."""
    count, _ = FAMILIES[rng.choice(list(FAMILIES))]
    values = rng.sample(range(1, 10), count)
    problem = strategy_problem(values)
    actions = random_template(rng) if rng.random() < guided_share else None
    procedure = weak_start_procedure(actions, rng, follow=follow, explore=explore)
    row = {"images": [], "problem": guided_problem(problem, actions) if actions else problem}
    return row, answer_text(apply_procedure(procedure, values))


def tokenizer_corpus() -> list[str]:
    """Texts the testbed tokenizer is trained on: problems, every action line, answers, the system prompt."""
    from mmpo.algos.tapo import render_template
    from mmpo.data.solution import SYSTEM_PROMPT

    rng = random.Random(0)
    texts = [SYSTEM_PROMPT, render_template(list(REASONING_ACTIONS))]
    texts += [strategy_problem(rng.sample(range(1, 10), FAMILIES[f][0])) for f in FAMILIES for _ in range(20)]
    texts += [answer_text(v) for v in range(1, 10)] * 4
    return texts


def build_weak_start(out: str | Path, *, seed: int = 0, steps: int = 600, batch_size: int = 32, lr: float = 2e-3,
                     hidden_size: int = 64, num_layers: int = 2, guided_share: float = 0.6, follow: float = 1.0,
                     explore: float = 0.15, log_every: int = 100) -> Path:
    """Build the tiny text LM under ``out/base`` and fine-tune it (``steps`` AdamW steps of ``batch_size``
    :func:`sft_example` pairs, seeded by ``seed``) into ``out/weak_start``, which is returned. Prompts use the
    default system prompt, as ``mmpo fit`` and ``mmpo tapo-library`` do."""
    from mmpo.training.optim import make_adamw
    from mmpo.vlm.factory import build_tiny_text_lm, load_vlm
    from mmpo.vlm.processing import encode_completions, encode_prompts

    out = Path(out)
    build_tiny_text_lm(out / "base", corpus=tokenizer_corpus(), vocab_size=400, hidden_size=hidden_size,
                       intermediate_size=2 * hidden_size, num_layers=num_layers, seed=seed)
    model, processor = load_vlm(out / "base")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = make_adamw(model.parameters(), lr=lr, weight_decay=0.01)  # torch AdamW's default decay
    model.train()
    for step in range(steps):
        pairs = [sft_example(rng, guided_share=guided_share, follow=follow, explore=explore) for _ in range(batch_size)]
        prompts = encode_prompts(processor, [row for row, _ in pairs])
        ids, mask = encode_completions(processor, [target for _, target in pairs])
        input_ids = torch.cat([prompts["input_ids"], ids], 1)
        attention = torch.cat([prompts["attention_mask"], mask], 1)
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, prompts["input_ids"].shape[1] - 1:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1),
                                                 reduction="none")
        loss = (loss * mask.reshape(-1)).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if log_every and step % log_every == 0:
            print(f"weak start step {step}: loss {loss.item():.4f}", flush=True)
    model.save_pretrained(out / "weak_start")
    processor.save_pretrained(out / "weak_start")
    return out / "weak_start"


class GroupCountingGRPOModule(GRPOModule):
    """GRPO, logging ``tapo/all_wrong_group_frac`` (groups whose every reward is <= 0) as TAPO does; training is
    GRPO's, unchanged."""

    def compute_rewards(self, rollout):
        rewards, metrics = super().compute_rewards(rollout)
        unguided = torch.zeros(len(rewards), dtype=torch.bool)
        metrics["tapo/all_wrong_group_frac"] = tapo_metrics(rewards, rollout.group_ids, unguided)[
            "tapo/all_wrong_group_frac"]
        return rewards, metrics
