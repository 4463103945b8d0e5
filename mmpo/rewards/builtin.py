"""Built-in rewards: accuracy, format, length.

The default VLM reward is 0.9 x accuracy + 0.1 x format (PAPO / EasyR1,
arXiv 2507.06448; see docs/algorithm_sources.md section 0).

Each reward is scored by a torch-free function returning a list of floats (``accuracy_values``,
``format_values``, ``length_values``): the reward worker process runs those (its ``worker_form``,
``mmpo.rewards.registry``), so it never imports torch for them. The registered functions
(``accuracy_reward`` ...) return the same values as a (N,) float32 tensor, importing torch when
called (the trainer has it already).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mmpo.data.solution import render_solution
from mmpo.rewards.answers import extract_answer, row_answer_correct
from mmpo.rewards.registry import register_reward

if TYPE_CHECKING:
    import torch

_FORMAT_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def _check_lengths(completions: list[str], rows: list[dict[str, Any]]) -> None:
    if len(completions) != len(rows):
        raise ValueError(f"got {len(completions)} completions but {len(rows)} rows; pass one row per completion")


def _float32(values: list[float]) -> torch.Tensor:
    import torch

    return torch.tensor(values, dtype=torch.float32)


def accuracy_values(completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
    """:func:`accuracy_reward`'s values as a list of floats (no torch)."""
    _check_lengths(completions, rows)
    return [float(row_answer_correct(extract_answer(text), row)) for text, row in zip(completions, rows)]


@register_reward("accuracy", worker_form=accuracy_values)
def accuracy_reward(completions: list[str], rows: list[dict[str, Any]]) -> torch.Tensor:
    """1.0 when the completion's final answer equals ``row['answer']``, else 0.0.

    The answer is read from ``<answer>...</answer>`` (or ``\\boxed{}``, or R1-VL's
    ``### The final answer is:`` line); no answer gives 0. Numbers and LaTeX are
    compared with math-verify, word answers by normalised string. A countdown row (``numbers``,
    ``target``) takes any expression that uses exactly its numbers and equals the target
    (:func:`mmpo.rewards.answers.row_answer_correct`).

    Returns:
        (N,) float32.
    """
    return _float32(accuracy_values(completions, rows))


def is_think_answer_format(completion: str) -> bool:
    """True if the completion is exactly ``<think>...</think><answer>...</answer>``
    (whitespace around the blocks allowed; one block each; non-empty answer).

    Checked with tag counts and positions, linear in the length (the equivalent regex with two
    lazy groups re-scans the rest of the text from every candidate ``</think>``).
    """
    text = completion.strip()
    if not (text.startswith("<think>") and text.endswith("</answer>")):
        return False
    if any(text.count(tag) != 1 for tag in _FORMAT_TAGS):
        return False
    think_end, answer_start = text.index("</think>"), text.index("<answer>")
    if answer_start < think_end or text[think_end + len("</think>"):answer_start].strip():
        return False
    return bool(text[answer_start + len("<answer>"):-len("</answer>")].strip())


def format_values(completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
    """:func:`format_reward`'s values as a list of floats (no torch)."""
    _check_lengths(completions, rows)
    return [float(is_think_answer_format(text)) for text in completions]


@register_reward("format", worker_form=format_values)
def format_reward(completions: list[str], rows: list[dict[str, Any]]) -> torch.Tensor:
    """1.0 if the completion is a well-formed ``<think>...</think><answer>...</answer>``, else 0.0.

    Returns:
        (N,) float32.
    """
    return _float32(format_values(completions, rows))


def length_values(completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
    """:func:`length_reward`'s values as a list of floats (no torch)."""
    _check_lengths(completions, rows)
    scores = []
    for text, row in zip(completions, rows):
        length = len(text.split())
        reference = max(1, len(render_solution(row).split()))
        scores.append(0.0 if length == 0 else min(1.0, reference / length))
    return scores


@register_reward("length", worker_form=length_values)
def length_reward(completions: list[str], rows: list[dict[str, Any]]) -> torch.Tensor:
    """Brevity reward ``min(1, L_ref / L)`` with L the completion's word count and L_ref
    the word count of the row's reference solution (``render_solution(row)``).

    A completion no longer than the reference scores 1, twice as long 0.5; an empty
    completion scores 0. Combine with a small weight next to accuracy to discourage
    rambling without rewarding empty answers.

    Returns:
        (N,) float32.
    """
    return _float32(length_values(completions, rows))
