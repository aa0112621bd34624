"""Argument checks shared by :func:`gradwatch.check_gradients` and :class:`gradwatch.GradWatch`.

Each raises ``ValueError`` naming the argument, what was expected and what was received, at construction time rather
than at the first check hours into a run.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from collections.abc import Callable, Collection, Iterable
from typing import Any, ParamSpec, TypeVar

Arguments = ParamSpec("Arguments")
Result = TypeVar("Result")


def _received(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_int(name: str, value: Any, *, minimum: int) -> int:
    """An integer (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}; got {_received(value)}")
    return value


def check_optional_int(name: str, value: Any, *, minimum: int) -> int | None:
    """``None`` or an integer of at least ``minimum``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be None or an integer >= {minimum}; got {_received(value)}")
    return value


def check_fraction(name: str, value: Any, *, optional: bool = False, auto: bool = False) -> float | None:
    """A float strictly between 0 and 1 (or ``None`` when ``optional``; the message mentions ``"auto"`` when that is
    accepted too, by the caller)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1 or math.isnan(value):
        expected = ("'auto', " if auto else "") + ("None or a number" if optional else "a number")
        raise ValueError(f"`{name}` must be {expected} strictly between 0 and 1; got {_received(value)}")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    """A bool."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False; got {_received(value)}")
    return value


def check_choice(name: str, value: Any, choices: Collection[str], *, allow_callable: bool = False) -> Any:
    """One of ``choices`` (or, with ``allow_callable``, any callable)."""
    if allow_callable and callable(value):
        return value
    if not isinstance(value, str) or value not in choices:
        options = ", ".join(repr(c) for c in choices) + (" or a callable" if allow_callable else "")
        raise ValueError(f"`{name}` must be one of {options}; got {_received(value)}")
    return value


def check_optional_callable(name: str, value: Any) -> Any:
    """``None`` or a callable."""
    if value is not None and not callable(value):
        raise ValueError(f"`{name}` must be None or a callable; got {_received(value)}")
    return value


def check_patterns(name: str, value: Any) -> tuple[str, ...]:
    """A sequence of strings (shell-style patterns); a single string is refused, it is almost always a mistake for a
    one-element list."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(
            f"`{name}` must be a list or tuple of pattern strings, e.g. ['head.*']; got {_received(value)}"
        )
    return tuple(value)


def reject_unknown_options(given: Iterable[str], valid: Iterable[str], where: str) -> None:
    """Raise ``TypeError`` for keyword arguments ``where`` does not take, each with the nearest valid name (difflib's
    closest match, when one is close enough): a typo (``evry_n_steps=1``) is answered with what was meant
    (``every_n_steps``) instead of being silently kept or listed among every valid name."""
    names = sorted(set(valid))
    unknown = sorted(set(given) - set(names))
    if not unknown:
        return
    parts = []
    for name in unknown:
        near = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        parts.append(f"`{name}` (did you mean `{near[0]}`?)" if near else f"`{name}`")
    raise TypeError(f"{where} got unknown option(s) {', '.join(parts)}; its options are {', '.join(names)}")


def suggests_options(
    options: type | None = None,
) -> Callable[[Callable[Arguments, Result]], Callable[Arguments, Result]]:
    """Make a function (a class's ``__init__``) answer an unknown keyword with the nearest valid name (see
    :func:`reject_unknown_options`) instead of Python's bare "unexpected keyword argument": its own keyword names and
    the keys of ``options``, the ``TypedDict`` its ``**options`` are typed by."""
    keys: Collection[str] = getattr(options, "__optional_keys__", frozenset()) | getattr(
        options, "__required_keys__", frozenset()
    )

    def decorate(function: Callable[Arguments, Result]) -> Callable[Arguments, Result]:
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        parameters = inspect.signature(function).parameters.values()  # self and ** catch-alls left out
        names = (*(p.name for p in parameters if p.kind in kinds and p.name != "self"), *keys)
        where = f"{function.__qualname__.removesuffix('.__init__')}()"

        @functools.wraps(function)
        def checked(*args: Arguments.args, **kwargs: Arguments.kwargs) -> Result:
            reject_unknown_options(kwargs, names, where)
            return function(*args, **kwargs)

        return checked

    return decorate
