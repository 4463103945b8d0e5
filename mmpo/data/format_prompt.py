"""EasyR1-style format prompts: a jinja template that wraps each row's prompt.

EasyR1's data config names a template file (``format_prompt: ./examples/format_prompt/math.jinja``)
rendered with the prompt as ``content``, e.g.
``{{ content | trim }} You FIRST think ... put the final answer in \\boxed{}.``
Here ``format_prompt`` is such a file (``.jinja`` / ``.j2``) or the template text itself.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

TEMPLATE_SUFFIXES = (".jinja", ".j2", ".jinja2")


def template_text(format_prompt: str) -> str:
    """The template: the file's text for a ``.jinja`` / ``.j2`` path, else ``format_prompt`` itself."""
    if format_prompt.endswith(TEMPLATE_SUFFIXES):
        path = Path(format_prompt).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"format_prompt: template file not found: {path}")
        return path.read_text()
    return format_prompt


@lru_cache(maxsize=8)
def _compile(text: str) -> Any:
    import jinja2  # a transformers dependency (chat templates)
    import jinja2.meta

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False)
    try:
        variables = jinja2.meta.find_undeclared_variables(env.parse(text))
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"format_prompt: invalid jinja template ({exc})") from exc
    if "content" not in variables:
        raise ValueError(f"format_prompt must use {{{{ content }}}} (the row's prompt), got {text[:120]!r}")
    if variables - {"content"}:
        raise ValueError(f"format_prompt may use only {{{{ content }}}}; unknown: {sorted(variables - {'content'})}")
    return env.from_string(text)


def check_format_prompt(format_prompt: str) -> None:
    """Raise a clear error now (at config time) if the template cannot be used."""
    _compile(template_text(format_prompt))


def apply_format_prompt(format_prompt: str, prompt: str) -> str:
    """The row's prompt rendered into the template (as ``content``)."""
    return _compile(template_text(format_prompt)).render(content=prompt).strip()
