"""The watch's state in a Hugging Face ``Trainer``'s checkpoints: an entry of ``TrainerState.stateful_callbacks``,
which the Trainer saves in ``trainer_state.json`` with every checkpoint and reads back on
``trainer.train(resume_from_checkpoint=...)``: a resumed run continues the watch's schedule, budget and counters.
"""

from __future__ import annotations

from typing import Any, cast

from transformers import TrainerState

__all__ = ["STATE_KEY", "keep_state", "saved_state"]

STATE_KEY = "gradwatch"
"""The watch's entry in ``stateful_callbacks``."""


def _stateful(state: TrainerState) -> dict[str, Any]:
    """``state.stateful_callbacks``: a dict of states by name (a list before the Trainer's ``TrainerState`` turns it
    into one)."""
    if not isinstance(state.stateful_callbacks, dict):
        state.stateful_callbacks = {}  # type: ignore[assignment]
    return cast(dict[str, Any], state.stateful_callbacks)


def saved_state(state: TrainerState, key: str) -> dict[str, Any] | None:
    """The state kept under ``key`` in ``state`` (a checkpoint's, on resume), or ``None`` when it holds none."""
    saved = _stateful(state).get(key)
    return saved if isinstance(saved, dict) else None


def keep_state(state: TrainerState, key: str, value: dict[str, Any]) -> None:
    """Keep ``value`` (plain JSON values) under ``key`` in ``state``, where the Trainer's next checkpoint saves it."""
    _stateful(state)[key] = value
