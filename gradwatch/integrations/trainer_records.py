"""What a trainer records as it computes its loss, put back after a check.

A check evaluates the trainer's own ``compute_loss`` dozens of times, and TRL's trainers record at each call
(``SFTTrainer`` its entropy and token accuracy in ``_metrics`` and its ``_total_train_tokens``, GRPO-style trainers
completions in ``_logs``), which the next ``trainer.log`` averages: left in place, a check would change the values the
run logs (``num_tokens`` 7260 against 480). :func:`records_kept` saves the trainer's plain records (numbers, strings and
containers of them, whatever the trainer names them) before a check and puts back those the check changed, in place,
so that anything holding them still holds the same objects.
"""

from __future__ import annotations

import contextlib
import copy
from collections import deque
from collections.abc import Iterator
from typing import Any

_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_MAX_DEPTH = 4


def is_plain_record(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is plain data (scalars, and dicts, lists, tuples, deques of them, a few levels deep)."""
    if isinstance(value, _SCALARS):
        return True
    if depth >= _MAX_DEPTH:
        return False
    if isinstance(value, dict):
        return all(isinstance(k, _SCALARS) and is_plain_record(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple, deque)):
        return all(is_plain_record(item, depth + 1) for item in value)
    return False


def _restored(current: Any, saved: Any) -> Any:
    """``current`` with the contents of ``saved`` again: the same container objects where the types agree."""
    if type(current) is not type(saved):
        return saved
    if isinstance(current, dict):
        for key in [key for key in current if key not in saved]:
            del current[key]
        for key, value in saved.items():
            current[key] = _restored(current[key], value) if key in current else value
        return current
    if isinstance(current, (list, deque)):
        current.clear()
        current.extend(saved)
        return current
    return saved


@contextlib.contextmanager
def records_kept(owner: object) -> Iterator[None]:
    """Put back, on exit, every plain record among ``owner``'s attributes (see :func:`is_plain_record`) that changed
    meanwhile, and remove the plain attributes that appeared."""
    before = {name: copy.deepcopy(value) for name, value in vars(owner).items() if is_plain_record(value)}
    try:
        yield
    finally:
        attributes = vars(owner)
        for name, value in list(attributes.items()):
            if name not in before and is_plain_record(value):
                del attributes[name]
        for name, saved in before.items():
            current = attributes.get(name)
            if name not in attributes or current != saved or type(current) is not type(saved):
                attributes[name] = _restored(current, saved)
