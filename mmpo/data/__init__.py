"""Data for the VLM side: the Row schema, synthetic tasks, file loaders, the DataModule.

Light to import: loaders (datasets/pyarrow) and the DataModule (lightning) are
imported only from their own modules, ``mmpo.data.loaders`` and
``mmpo.data.datamodule``.
"""

from mmpo.data.schema import ROW_FIELDS, BadRowError, Row, validate_row
from mmpo.data.solution import STEPS_SYSTEM_PROMPT, SYSTEM_PROMPT, render_solution, system_prompt_for

__all__ = [
    "ROW_FIELDS",
    "STEPS_SYSTEM_PROMPT",
    "SYSTEM_PROMPT",
    "BadRowError",
    "Row",
    "render_solution",
    "system_prompt_for",
    "validate_row",
]
