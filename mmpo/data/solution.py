"""System prompts and rendering of a Row's reference solution into a completion.

Three styles:
- ``think-answer`` (default; what SFT teaches and the ``format`` reward checks):
  ``<think>{steps joined by spaces}</think><answer>{answer}</answer>``.
- ``steps`` (R1-VL / StepGRPO, arXiv 2503.12937, Mulberry layout):
  ``### Image Description: ...`` / ``### Rationales: ...`` / ``### Step k: ...`` /
  ``### The final answer is: {answer}``, one section per line.
- ``answer``: the row's ``answer`` alone, no system prompt (a policy that writes text rather than solves:
  the TAROT testbed's rewriter, ``mmpo.rewards.tarot_testbed``).
"""

from __future__ import annotations

from typing import Any, Literal

SolutionStyle = Literal["think-answer", "steps", "answer"]

SYSTEM_PROMPT: str = (
    "Think step by step inside <think> </think>, then give only the final answer inside <answer> </answer>."
)
"""Default system prompt: asks for the think/answer format that ``render_solution`` produces."""

STEPS_SYSTEM_PROMPT: str = (
    "Answer in sections: ### Image Description:, ### Rationales:, ### Step 1:, ... "
    "and end with ### The final answer is:."
)
"""System prompt for the StepGRPO ("steps") style."""

DEFAULT_IMAGE_DESCRIPTION = "The image shows the figure for the question."
NO_IMAGE_DESCRIPTION = "There is no image."
DEFAULT_RATIONALE = "I solve the question step by step."


def system_prompt_for(style: SolutionStyle = "think-answer") -> str:
    """The system prompt matching a solution style."""
    if style == "think-answer":
        return SYSTEM_PROMPT
    if style == "steps":
        return STEPS_SYSTEM_PROMPT
    if style == "answer":
        return ""  # no system turn
    raise ValueError(f"unknown solution style {style!r}; valid: 'think-answer', 'steps', 'answer'")


def render_solution(row: dict[str, Any], style: SolutionStyle = "think-answer") -> str:
    """Render ``row['steps']`` and ``row['answer']`` as a target completion.

    Args:
        row: a Row (needs ``steps`` and ``answer``; the steps style also uses the
            optional ``image_description`` and ``rationale`` fields, with defaults).
        style: ``"think-answer"``, ``"steps"`` or ``"answer"``.

    Returns:
        The completion text (no chat markup, no EOS).
    """
    steps = [s.strip() for s in row.get("steps") or [] if s and s.strip()]
    answer = str(row["answer"]).strip()
    if style == "think-answer":
        return f"<think>{' '.join(steps)}</think><answer>{answer}</answer>"
    if style == "steps":
        default_desc = DEFAULT_IMAGE_DESCRIPTION if row.get("images") else NO_IMAGE_DESCRIPTION
        lines = [
            f"### Image Description: {row.get('image_description') or default_desc}",
            f"### Rationales: {row.get('rationale') or DEFAULT_RATIONALE}",
        ]
        # A row without worked steps still gets one valid step so StepRVR's format holds.
        for k, step in enumerate(steps or [f"The answer is {answer}."], start=1):
            lines.append(f"### Step {k}: {step}")
        lines.append(f"### The final answer is: {answer}")
        return "\n".join(lines)
    if style == "answer":
        return answer
    raise ValueError(f"unknown solution style {style!r}; valid: 'think-answer', 'steps', 'answer'")
