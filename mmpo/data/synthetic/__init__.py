"""Synthetic visual reasoning tasks rendered with PIL, deterministic by seed.

Built-in tasks (``TASKS``): count_shapes, shape_position, relative_position,
compare_size, bar_chart, triangle_angle (all need the image), arithmetic (text only), and the
text LM tasks ``TEXT_TASKS``: long_arithmetic, word_problem, countdown, ``TEXT_TEACHER_TASKS``: inventory, and
``TESTBED_TASKS``: strategy_mix (the TAPO testbed).
Other modules add tasks with ``@register_task(name)``.
"""

from mmpo.data.synthetic.registry import (
    DEFAULT_IMAGE_SIZE,
    DIFFICULTIES,
    SPLIT_BUCKETS,
    TASKS,
    corpus,
    get_task,
    make_items,
    register_task,
)

# Importing the task modules registers the built-in tasks.
from mmpo.data.synthetic import shapes_tasks, chart_tasks, geometry_tasks, text_tasks, agent_tasks, dialogue_tasks  # noqa: E402,F401
from mmpo.data.synthetic import strategy_tasks  # noqa: E402,F401

VISUAL_TASKS: tuple[str, ...] = (
    "count_shapes", "shape_position", "relative_position", "compare_size", "bar_chart", "triangle_angle",
)
"""The built-in tasks that need the image (the default task mix)."""

TEXT_TASKS: tuple[str, ...] = ("long_arithmetic", "word_problem", "countdown")
"""The built-in text-only reasoning tasks for text LMs (mmpo.data.synthetic.text_tasks; docs/llm.md)."""

TEXT_TEACHER_TASKS: tuple[str, ...] = ("inventory",)
"""Text tasks the tiny text LM learns, whose questions name a colour: the text quickstart's abstaining-teacher
evidence (mmpo.data.synthetic.text_tasks, mmpo.data.demonstrations; docs/llm.md)."""

AGENT_TASKS: tuple[str, ...] = ("calc", "zoom", "zoom_digit", "zoom_digit_at", "zoom_digit_read", "zoom_digit_box",
                                "zoom_digit_box_read", "zoom_texture", "zoom_texture_read", "twohop", "codebook",
                                "codebook_pair")
"""Tasks where a tool must help (mmpo.data.synthetic.agent_tasks; docs/agents.md). The tiny VLM's default tokenizer
corpus leaves them out (mmpo.vlm.factory.default_corpus): a task added here keeps every tiny-VLM golden run."""

TESTBED_TASKS: tuple[str, ...] = ("strategy_mix",)
"""Text tasks built for one method's testbed (strategy_mix: TAPO, mmpo.data.synthetic.strategy_tasks)."""

DIALOGUE_TASKS: tuple[str, ...] = ("lock",)
"""Multi-turn dialogue tasks against a scripted target (mmpo.data.synthetic.dialogue_tasks; docs/dialtree_rpo.md)."""

__all__ = [
    "DEFAULT_IMAGE_SIZE",
    "DIFFICULTIES",
    "SPLIT_BUCKETS",
    "TASKS",
    "TEXT_TASKS",
    "TEXT_TEACHER_TASKS",
    "AGENT_TASKS",
    "DIALOGUE_TASKS",
    "TESTBED_TASKS",
    "VISUAL_TASKS",
    "corpus",
    "get_task",
    "make_items",
    "register_task",
]
from mmpo.data import geometry_aux  # noqa: E402,F401  (GCPO task; registers itself)
