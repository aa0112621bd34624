"""Trainable parameters the loss never reaches: ``requires_grad``, yet no gradient after the backward.

A forward that drops a parameter (a wrapper whose ``__torch_function__`` passes ``F.linear`` the weight without the
bias, torchao #4846; a branch never taken; a layer built and never called) trains it never, in silence: the optimizer
skips a parameter without ``.grad``. Nothing is wrong with the gradient of the others, so a check does not fail; it
notes them, by name and module (code ``unreached-parameters``), so that a bias meant to train is seen not to. The
recomputed check probes each such parameter first (a flat loss confirms the zero gradient, a moving one shows it is
missing, and fails): a parameter one of its probes failed is a failure, not a note.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import Probe

SHOWN = 8
"""How many such parameters the note names (then how many more)."""


def unreached_note(
    model: nn.Module,
    params: Sequence[tuple[str, Tensor]],
    grads: Sequence[Tensor | None],
    probes: Sequence[Probe] = (),
    *,
    probed: bool = True,
) -> list[Note]:
    """The note naming the trainable ``params`` whose gradient in ``grads`` is ``None`` (none when there are none, or
    when a probe of each failed: the loss depends on it and the failing check says so). ``probed``: whether this check's
    probes looked at them (the recomputed check's do; the applied check's cannot, having no gradient to compare)."""
    failed = {probe.target for probe in probes if probe.verdict == "fail"}
    left = [name for (name, _), grad in zip(params, grads, strict=True) if grad is None and name not in failed]
    if not left:
        return []
    looked = {probe.target for probe in probes}
    shown = ", ".join(_described(model, name) for name in left[:SHOWN])
    more = f" and {len(left) - SHOWN} more" if len(left) > SHOWN else ""
    if not probed:
        why = "the applied check has no gradient of theirs to compare; the recomputed check probes them"
    elif all(name in looked for name in left):
        why = "this check's probes found the loss flat in them"
    else:
        why = f"{sum(name in looked for name in left)} of them probed at this check, the loss flat in each"
    text = (
        f"{len(left)} trainable parameter(s) the loss never reaches: requires_grad, but no gradient after the backward "
        f"({why}): {shown}{more}. The forward drops them (a wrapper's __torch_function__, an unused branch or layer) "
        "and they never train; set requires_grad=False if that is meant"
    )
    return [Note(NoteCode.UNREACHED_PARAMETERS, text)]


def _described(model: nn.Module, name: str) -> str:
    """``'layer.bias' (bias of Linear 'layer')``: the parameter with its module's class and path."""
    path, _, attribute = name.rpartition(".")
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return f"'{name}'"
    if not path:
        return f"'{name}' (of the model, {type(module).__name__})"
    return f"'{name}' ({attribute} of {type(module).__name__} '{path}')"
