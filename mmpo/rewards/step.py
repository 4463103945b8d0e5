"""StepGRPO's step-wise rewards (R1-VL, arXiv 2503.12937): StepRAR and StepRVR.

Both are pure string functions over the R1-VL (Mulberry-style) response format::

    ### Image Description: ...
    ### Rationales: ...
    ### Step 1: ...
    ...
    ### Step K: ...
    ### The final answer is: <answer>

- StepRAR (step-wise reasoning accuracy): 1[answer correct] + alpha * k, where k is the fraction
  of the item's key-step groups matched (a group is a list of equivalent strings; it matches if
  any of them, lower-cased, is a substring of the lower-cased text of the Step sections).
  alpha = 0.1. The paper gives 0 when no answer is given; the official code does not, so that
  rule is the option ``no_answer_zero``.
- StepRVR (step-wise reasoning validity), binary: all four headers present, the steps numbered
  exactly 1..K in order, and the final-answer header after the last step.

StepGRPO sums the two (reward weights 1 and 1) before group normalisation.
Source: ``jingyi0000/R1-VL:src/r1-vl/src/open_r1/grpo.py``; docs/algorithm_sources.md section 2.
"""

from __future__ import annotations

from dataclasses import dataclass
import re
from typing import Any, Sequence

import torch
from torch import Tensor

from mmpo.rewards import answers_match, register_reward

DESCRIPTION_HEADER = "### Image Description:"
RATIONALES_HEADER = "### Rationales:"
FINAL_ANSWER_HEADER = "### The final answer is:"
STEP_HEADER = re.compile(r"### Step (\d+):")

KEY_STEP_MISSING_POLICIES = ("error", "skip")


def _section_end(text: str, start: int) -> int:
    """Position of the next ``###`` at or after ``start`` that begins a line (only whitespace, with a
    newline, between it and ``start`` or the previous text), else ``len(text)``.

    Linear overall: the whitespace walked back over before each ``###`` is a different stretch.
    """
    header = text.find("###", start)
    while header >= 0:
        pos = header - 1
        while pos >= start and text[pos].isspace():
            if text[pos] == "\n":
                return header
            pos -= 1
        header = text.find("###", header + 1)
    return len(text)


def step_sections_text(completion: str) -> str:
    """Concatenated, lower-cased text of all ``### Step N:`` sections (the only text StepRAR searches).

    A section runs from its header to the next ``###`` header at a line start, or the end.
    """
    bodies = []
    pos = 0
    while (header := STEP_HEADER.search(completion, pos)) is not None:
        end = _section_end(completion, header.end())
        bodies.append(completion[header.end():end].strip())
        pos = end
    return "\n".join(bodies).lower()


def extract_final_answer(completion: str) -> str | None:
    """The first line after the last ``### The final answer is:`` header; None if absent or empty."""
    position = completion.rfind(FINAL_ANSWER_HEADER)
    if position < 0:
        return None
    rest = completion[position + len(FINAL_ANSWER_HEADER):].strip()
    answer = rest.splitlines()[0].strip() if rest else ""
    return answer or None


def key_step_match_fraction(completion: str, key_steps: Sequence[Sequence[str] | str]) -> float:
    """k = (matched key-step groups) / (number of groups).

    Args:
        completion: the model's response.
        key_steps: groups of equivalent strings; a bare string is a one-element group.

    Returns:
        k in [0, 1]; 0.0 when there are no groups.
    """
    if not key_steps:
        return 0.0
    haystack = step_sections_text(completion)
    matched = 0
    for group in key_steps:
        alternatives = [group] if isinstance(group, str) else list(group)
        if any(alt.strip().lower() and alt.strip().lower() in haystack for alt in alternatives):
            matched += 1
    return matched / len(key_steps)


def _row_id(row: dict[str, Any]) -> str:
    return str(row.get("id", "<no id>"))


def step_rar(
    completions: list[str],
    rows: list[dict[str, Any]],
    *,
    alpha: float = 0.1,
    no_answer_zero: bool = False,
    on_missing_key_steps: str = "error",
) -> Tensor:
    """StepRAR: r = 1[correct] + alpha * k (R1-VL, arXiv 2503.12937, Eq. 5).

    Args:
        completions: N responses.
        rows: N dataset rows (``answer``, ``key_steps``, ``id``).
        alpha: key-step weight (paper 0.1).
        no_answer_zero: the paper's rule "no final answer -> reward 0" (the code lacks it).
        on_missing_key_steps: ``"error"`` raises ValueError naming the row when ``key_steps``
            is missing or empty; ``"skip"`` scores k = 0 for it (StepGRPO's module counts these).

    Returns:
        ``(N,)`` float32 rewards.
    """
    if len(completions) != len(rows):
        raise ValueError(f"{len(completions)} completions but {len(rows)} rows")
    if on_missing_key_steps not in KEY_STEP_MISSING_POLICIES:
        raise ValueError(
            f"on_missing_key_steps must be one of {KEY_STEP_MISSING_POLICIES}, got {on_missing_key_steps!r}"
        )
    rewards = []
    for completion, row in zip(completions, rows):
        key_steps = row.get("key_steps")
        if not key_steps and on_missing_key_steps == "error":
            raise ValueError(
                f"row {_row_id(row)!r} has no key_steps; StepRAR needs them "
                "(or set on_missing_key_steps='skip' to score k = 0 and count the row)"
            )
        answer = extract_final_answer(completion)
        if answer is None and no_answer_zero:
            rewards.append(0.0)
            continue
        correct = answer is not None and answers_match(answer, str(row["answer"]))
        rewards.append(float(correct) + alpha * key_step_match_fraction(completion, key_steps or []))
    return torch.tensor(rewards, dtype=torch.float32)


def is_valid_step_format(completion: str) -> bool:
    """StepRVR's validity test (R1-VL, arXiv 2503.12937, Eq. 6).

    Completeness: ``### Image Description:``, ``### Rationales:``, ``### Step 1:`` and
    ``### The final answer is:`` all occur. Logic: step numbers read exactly 1, 2, ..., K in order
    of appearance, and the final-answer header comes after the last step header.
    """
    required = (DESCRIPTION_HEADER, RATIONALES_HEADER, "### Step 1:", FINAL_ANSWER_HEADER)
    if not all(header in completion for header in required):
        return False
    step_matches = list(STEP_HEADER.finditer(completion))
    # int() refuses numbers over 4300 digits, which a model can write: such a step number is wrong.
    numbers = [int(m.group(1)) if len(m.group(1)) <= 18 else -1 for m in step_matches]
    if numbers != list(range(1, len(numbers) + 1)):
        return False
    return completion.rfind(FINAL_ANSWER_HEADER) > step_matches[-1].start()


def step_rvr(completions: list[str], rows: list[dict[str, Any]]) -> Tensor:
    """StepRVR: 1.0 for a structurally valid step-wise response, else 0.0.

    Args:
        completions: N responses.
        rows: N dataset rows (unused; the reward-function signature).

    Returns:
        ``(N,)`` float32 rewards.
    """
    if len(completions) != len(rows):
        raise ValueError(f"{len(completions)} completions but {len(rows)} rows")
    return torch.tensor([float(is_valid_step_format(c)) for c in completions], dtype=torch.float32)


def step_rar_reward_name(*, no_answer_zero: bool = False, skip_missing_key_steps: bool = False) -> str:
    """Registered name of the StepRAR variant with these options (alpha is the paper's 0.1)."""
    name = "step_rar"
    if no_answer_zero:
        name += "_no_answer_zero"
    if skip_missing_key_steps:
        name += "_skip_missing"
    return name


@dataclass(frozen=True)
class StepRARVariant:
    """StepRAR with fixed options, called as the registry's ``fn(completions, rows)``. A module-level class
    (not a closure) so that it pickles to the reward worker, where its deadline can stop a hang."""

    no_answer_zero: bool = False
    skip_missing_key_steps: bool = False

    @property
    def __name__(self) -> str:  # logs and errors name the reward as registered
        return step_rar_reward_name(no_answer_zero=self.no_answer_zero,
                                    skip_missing_key_steps=self.skip_missing_key_steps)

    def __call__(self, completions: list[str], rows: list[dict[str, Any]]) -> Tensor:
        return step_rar(completions, rows, no_answer_zero=self.no_answer_zero,
                        on_missing_key_steps="skip" if self.skip_missing_key_steps else "error")


def _register_step_rar_variants() -> None:
    # One registered callable per option combination: the registry's signature is fn(completions, rows), so
    # options are fixed at registration (alpha is the paper's 0.1).
    for no_answer_zero in (False, True):
        for skip in (False, True):
            variant = StepRARVariant(no_answer_zero, skip)
            register_reward(variant.__name__)(variant)


_register_step_rar_variants()


@register_reward("step_rvr")
def step_rvr_reward(completions: list[str], rows: list[dict[str, Any]]) -> Tensor:
    """Registered StepRVR."""
    return step_rvr(completions, rows)
