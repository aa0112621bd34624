"""Which reference update rule an optimizer's param group is checked against, recognised by what the optimizer is: its
class name and the keys of its param group (duck typing), not its inheritance, so that the classes other libraries ship
for the same algorithms (a fused Adam, a Muon with auxiliary Adam groups) are checked against the same rule.

:func:`reference_for` returns ``None`` for an optimizer none of the rules fits: the update check then replays it
(:mod:`gradwatch.engine.update.replay`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gradwatch.engine.update.algorithms import UpdateRule, adafactor, adam, rmsprop, sgd
from gradwatch.engine.update.muon import FLOOR_VARIANTS, keller_aux_adam, keller_muon, torch_muon

__all__ = ["Reference", "reference_for"]

ADAMS = {"adam", "adamw"}
"""Class names (lower case) of Adams whose update is torch's Adam or AdamW rule, their step count in the state (a
fused Adam that counts steps per group, as DeepSpeed's do, is replayed instead)."""


@dataclass(frozen=True)
class Reference:
    """The rule a param group's update is checked against.

    Attributes:
        name: What the report names it (``"torch.optim.AdamW"``, ``"Muon (Keller Jordan)"``).
        hyper: The group's hyperparameters as the rule reads them (a decoupled-decay flag made explicit).
        variants: Settings added to ``hyper`` for the floor's re-runs in the optimizer's dtype, the floor the largest
            of their distances from the reference (Muon's two orders of operations); one empty one for the others.
    """

    name: str
    rule: UpdateRule
    hyper: Mapping[str, Any]
    variants: tuple[Mapping[str, Any], ...] = ({},)


def reference_for(optimizer: Any, group: Mapping[str, Any]) -> Reference | None:
    """The reference rule for ``group`` of ``optimizer`` (its hyperparameters, without ``params``), or ``None``: the
    first class of its method resolution order whose name and the group's keys fit a rule (a subclass of ``AdamW`` is
    checked against AdamW's rule: one that changes the update is what the check is for)."""
    hyper = {key: value for key, value in group.items() if key != "params"}
    for klass in type(optimizer).__mro__:
        found = _by_name(optimizer, klass.__name__, type(optimizer).__name__, group, hyper)
        if found is not None:
            return found
    return None


def _by_name(optimizer: Any, kind: str, own: str, group: Mapping[str, Any], hyper: dict[str, Any]) -> Reference | None:
    lower = kind.lower()
    if "muon" in lower:
        if "use_muon" in group and not group["use_muon"]:
            return Reference(f"{own} auxiliary Adam (Keller Jordan's adam_update)", keller_aux_adam, hyper)
        if group.keys() >= {"ns_coefficients", "ns_steps", "momentum", "lr"}:
            return Reference(_named(own, "Muon"), torch_muon, hyper, FLOOR_VARIANTS)
        if group.keys() >= {"lr", "momentum"}:
            return Reference(f"{own} (Keller Jordan's muon_update)", keller_muon, hyper, FLOOR_VARIANTS)
        return None
    if lower in ADAMS and group.keys() >= {"lr", "betas", "eps"}:
        decoupled = group.get("decoupled_weight_decay", lower.endswith("w"))
        return Reference(_named(own, "AdamW" if decoupled else "Adam"), adam,
                         {**hyper, "decoupled_weight_decay": bool(decoupled)})  # fmt: skip
    if lower == "sgd" and group.keys() >= {"lr", "momentum", "dampening", "nesterov", "weight_decay"}:
        return Reference(_named(own, "SGD"), sgd, hyper)
    if lower == "rmsprop" and group.keys() >= {"lr", "alpha", "eps", "centered", "momentum"}:
        return Reference(_named(own, "RMSprop"), rmsprop, hyper)
    if lower == "adafactor" and group.keys() >= {"lr", "beta2_decay", "eps", "d"}:
        return Reference(_named(own, "Adafactor"), adafactor, hyper)
    return None


def _named(kind: str, rule: str) -> str:
    return f"torch.optim.{rule}" if kind == rule else f"{kind} (torch's {rule} rule)"
