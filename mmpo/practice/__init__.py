"""Optimisation in prompt space: Training-Free GRPO (an experience library learned with frozen weights).

See docs/prompt_space.md."""

from mmpo.practice.experience import apply_operations, extract_experiences, parse_operations, partially_correct
from mmpo.practice.loop import PracticeConfig, TrainingFreeGRPO
from mmpo.practice.updater import ExperienceUpdater, Group

__all__ = ["ExperienceUpdater", "Group", "PracticeConfig", "TrainingFreeGRPO", "apply_operations",
           "extract_experiences", "parse_operations", "partially_correct"]
