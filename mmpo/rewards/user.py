"""Reward functions from the user's own code, called the way TRL calls them.

A reward setting (``reward_weights`` key) is either a registered name (``accuracy``) or a
spec of a function of your own:

- ``path/to/file.py:function``: the file is loaded by path (``importlib.util.spec_from_file_location``;
  a relative path is resolved from the working directory when the setting is validated);
- ``package.module:function``: imported with ``importlib.import_module`` (it must be on ``sys.path``).

The function has TRL's signature ``fn(prompts, completions, **columns) -> list[float | None]``:
``prompts[i]`` is the question text (the row's ``problem``) that completion ``i`` answers,
``completions[i]`` the completion text, and every other field of the rows is passed by name as a
list with one entry per completion (``answer=[...]``, ``images=[...]``, any custom column). A
function without ``**kwargs`` gets only the columns it names. ``None`` means "not applicable":
that completion's weighted sum skips this function (``mmpo.rewards.compute``).

:func:`validate_reward_weights` imports every function and checks its signature, so a bad
spec fails when the config is read, before a model loads. :class:`UserReward` adapts such a
function to the internal ``fn(completions, rows)`` signature; it pickles as its spec, so the
reward worker process loads the same file by path and a missed deadline can really stop it.
"""

from __future__ import annotations

import inspect
import math
import numbers
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from mmpo.rewards.registry import REWARDS, RewardFn, get_reward

from mmpo.plugins import SPEC_SEPARATOR, PluginSpec, PluginSpecError, function_of, import_module, load_file, parse_spec

TRL_SIGNATURE = "fn(prompts, completions, **columns) -> list[float | None]"

_ARGUMENTS = ("prompts", "completions")

RewardSpecError = PluginSpecError
"""A reward setting that names no usable function; the message names the spec and the problem
(the plug-in loader's error, :mod:`mmpo.plugins`)."""

RewardSpec = PluginSpec
"""A parsed user reward spec (:class:`mmpo.plugins.PluginSpec` of kind ``reward``)."""


def is_user_reward_spec(name: str) -> bool:
    """True for ``file.py:fn`` / ``module:fn`` specs, False for registered names (no ``:``)."""
    return SPEC_SEPARATOR in name


def parse_reward_spec(text: str) -> RewardSpec:
    """Split ``file.py:fn`` or ``package.module:fn`` (a path is made absolute from the working directory).

    Raises:
        RewardSpecError: an empty file/module or function part, or a module name that is not dotted identifiers.
    """
    return parse_spec(text, "reward")


# the loader's steps under their former names (mmpo.algos.inpo loads its functions with them)
_load_file = load_file
_import_module = import_module
_function_of = function_of


def _accepted_names(spec: RewardSpec, fn: Callable) -> tuple[frozenset[str] | None, tuple[str, ...]]:
    """The keyword names ``fn`` accepts (None: it takes ``**kwargs``, i.e. every column), and the
    columns it requires (named, no default).

    Raises:
        RewardSpecError: ``prompts`` or ``completions`` cannot be passed by keyword, or a
        parameter without default can only be passed by position.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have no signature: called as they are
        return None, ()
    params = list(signature.parameters.values())
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    by_keyword = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                       inspect.Parameter.KEYWORD_ONLY)}
    positional_only = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_ONLY
                       and p.default is inspect.Parameter.empty]
    missing = [name for name in _ARGUMENTS if name not in by_keyword and not takes_kwargs]
    if missing or positional_only:
        problem = (f"does not accept {' and '.join(missing)} by keyword" if missing
                   else f"has positional-only parameter(s) {positional_only}")
        raise RewardSpecError(f"reward {spec.text!r}: bad signature {spec.attribute}{signature}: it {problem}; "
                              f"expected TRL's {TRL_SIGNATURE} (named columns, or **kwargs for all of them)")
    required = tuple(p.name for p in params if p.name in by_keyword and p.name not in _ARGUMENTS
                     and p.default is inspect.Parameter.empty)
    return (None if takes_kwargs else frozenset(by_keyword)), required


def _scores(value: Any, n: int) -> list[float | None]:
    """The function's result as N floats or None (not applicable); malformed results raise.

    Imports no torch (the reward worker runs this): a tensor can only come from a function that
    imported torch itself, so it is recognised through ``sys.modules``."""
    torch = sys.modules.get("torch")
    is_tensor = torch.is_tensor if torch is not None else (lambda _: False)
    if is_tensor(value):
        value = value.detach().reshape(-1).tolist()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"returned a {type(value).__name__}; expected a list of float or None")
    items = list(value)
    if len(items) != n:
        raise ValueError(f"returned {len(items)} values for {n} completions")
    scores: list[float | None] = []
    for index, item in enumerate(items):
        if item is None:
            scores.append(None)
        elif isinstance(item, numbers.Real):
            scores.append(float(item))
        elif is_tensor(item) and item.numel() == 1:
            scores.append(float(item))
        else:
            raise TypeError(f"returned a {type(item).__name__} for completion {index}; "
                            f"expected a float or None")
    return scores


class UserReward:
    """A user function with TRL's signature, called as a registered reward ``fn(completions, rows)``.

    Returns N floats or None from a call (``None`` = not applicable). Pickles as its canonical
    spec: the reward worker loads the function itself (by file path or module import).
    """

    def __init__(self, spec: RewardSpec) -> None:
        module = _load_file(spec) if spec.file is not None else _import_module(spec)
        self.spec = spec
        self.function = _function_of(spec, module)
        self.accepted, self.required_columns = _accepted_names(spec, self.function)

    def __reduce__(self) -> tuple[Callable, tuple[str]]:
        return _user_reward_for_canonical_spec, (self.spec.canonical,)

    def __repr__(self) -> str:
        return f"UserReward({self.spec.text!r})"

    def __call__(self, completions: list[str], rows: list[Mapping[str, Any]]) -> list[float | None]:
        if len(completions) != len(rows):
            raise ValueError(f"got {len(completions)} completions but {len(rows)} rows; pass one row per completion")
        columns: dict[str, list[Any]] = {}
        for row in rows:
            for key in row:
                if key not in _ARGUMENTS and key not in columns:
                    columns[key] = [other.get(key) for other in rows]
        absent = [name for name in self.required_columns if name not in columns]
        if absent:
            available = sorted({key for row in rows for key in row})
            raise LookupError(f"needs column(s) {absent} that the rows do not have; their columns: {available}")
        if self.accepted is not None:
            columns = {key: values for key, values in columns.items() if key in self.accepted}
        prompts = [str(row.get("problem", "")) for row in rows]
        return _scores(self.function(prompts=prompts, completions=list(completions), **columns),
                       len(completions))


_USER_REWARDS: dict[str, UserReward] = {}
"""Loaded user rewards by canonical spec (one object per function: stable identity for compute's caches)."""


def _user_reward(spec: RewardSpec) -> UserReward:
    reward = _USER_REWARDS.get(spec.canonical)
    if reward is None:
        reward = _USER_REWARDS.setdefault(spec.canonical, UserReward(spec))
    return reward


def _user_reward_for_canonical_spec(canonical: str) -> UserReward:
    """Unpickling a :class:`UserReward` (in the reward worker) loads its function here."""
    return _user_reward(parse_reward_spec(canonical))


def resolve_reward(name: str) -> RewardFn:
    """The reward ``fn(completions, rows)`` for a registered name or a user spec (loaded once).

    Raises:
        RewardSpecError: an unknown registered name (listing the valid ones) or an unusable spec
        (file not found, import failed, no such function, not callable, bad signature).
    """
    if not is_user_reward_spec(name):
        from mmpo.rewards.models import get_model_reward

        model_reward = get_model_reward(name)
        if model_reward is not None:  # rewards.models (mmpo.rewards.models)
            return model_reward
        try:
            return get_reward(name)
        except KeyError:
            raise RewardSpecError(
                f"unknown reward {name!r}; registered: {sorted(REWARDS)}; a function of your own is given "
                f"as 'path/to/file.py:function' or 'package.module:function', a model as an entry of "
                f"rewards.models") from None
    return _user_reward(parse_reward_spec(name))


def reward_label(name: str) -> str:
    """The ``<name>`` of ``rewards/<name>/*`` metrics: the registered name, or a user function's own name."""
    return parse_reward_spec(name).attribute.rsplit(".", 1)[-1] if is_user_reward_spec(name) else name


def validate_reward_weights(weights: Mapping[str, Any] | None, setting: str = "reward_weights",
                            models: Mapping[str, Any] | None = None) -> None:
    """Check a ``name or spec -> weight`` mapping before anything expensive runs.

    Every user function is imported and its signature checked; registered names must exist;
    weights must be finite numbers; two rewards may not log under the same ``rewards/<name>``.
    ``models`` (``rewards.models``) are parsed and loaded first (``mmpo.rewards.models``), once per
    process, so their names resolve; each must be weighted.

    Raises:
        ValueError: naming ``setting``, the reward and what is wrong.
    """
    if models:
        from mmpo.rewards.models import register_model_rewards

        unweighted = sorted(set(models) - set(weights or {}))
        if unweighted:
            raise ValueError(f"rewards.models defines {unweighted} but {setting} gives them no weight; "
                             f"add them to {setting} (weights: {dict(weights or {})})")
        register_model_rewards(models)
    if weights is None:
        return
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError(f"{setting} must be a non-empty mapping of reward name or 'file.py:function' to weight, "
                         f"got {weights!r}")
    labels: dict[str, str] = {}
    for name, weight in weights.items():
        if not isinstance(name, str):
            raise ValueError(f"{setting}: reward names are strings, got {name!r}")
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ValueError(f"{setting}: the weight of {name!r} must be a finite number, got {weight!r}")
        try:
            resolve_reward(name)
        except RewardSpecError as exc:
            raise RewardSpecError(f"{setting}: {exc}") from exc
        label = reward_label(name)
        if label in labels:
            raise ValueError(f"{setting}: {labels[label]!r} and {name!r} would both log as rewards/{label}/*; "
                             f"give the functions distinct names")
        labels[label] = name
