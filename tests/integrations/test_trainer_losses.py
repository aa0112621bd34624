"""Which Trainer losses the callback checks with their detached values held (gradwatch/integrations/trainer_losses.py):
TRL's GRPO trainers and their subclasses, recognised by class name, unless the user chose otherwise."""

from __future__ import annotations

from typing import Any

import pytest

from gradwatch import ProbeSettings
from gradwatch.integrations.trainer_losses import surrogate_objective, trainer_options

pytestmark = pytest.mark.slow


class GRPOTrainer:  # named as TRL's: recognised without importing TRL
    pass


class MyGRPO(GRPOTrainer):
    pass


class SFTTrainer:
    pass


def _loss(model: Any, inputs: Any) -> Any:
    return None


@pytest.mark.parametrize(
    ("trainer", "expected"),
    [(GRPOTrainer(), True), (MyGRPO(), True), (SFTTrainer(), False)],
    ids=["grpo", "subclass", "sft"],
)
def test_grpo_trainers_and_their_subclasses_are_surrogate_objectives(trainer: Any, expected: bool) -> None:
    assert surrogate_objective(trainer) is expected
    held = {"hold_detached": True} if expected else {}
    assert trainer_options(trainer, None, {"seed": 1}) == {"seed": 1, **held}


@pytest.mark.parametrize(
    ("loss_fn", "settings", "options"),
    [(_loss, None, {}), (None, ProbeSettings(), {}), (None, None, {"hold_detached": False})],
    ids=["own-loss-fn", "settings-whole", "said-off"],
)
def test_what_the_user_chose_is_kept(loss_fn: Any, settings: Any, options: dict[str, Any]) -> None:
    given = {**options, "loss_fn": loss_fn} if loss_fn is not None else options
    assert trainer_options(GRPOTrainer(), settings, given) == given  # type: ignore[arg-type]
