"""What every check does around its measurements: :class:`CheckSession`.

A recomputed check (:func:`~gradwatch.engine.recomputed.check.check_gradients`) and an applied one
(:func:`~gradwatch.engine.applied.check.check_applied_gradient`) are each a measurement plan run inside one session,
which owns what the two have in common so that they cannot drift apart: the validated arguments
(:meth:`CheckSession.open`), the parameters probed (:meth:`CheckSession.select`), the measurements' conditions and
what could not be put back (:meth:`CheckSession.measuring`), and the one report (:meth:`CheckSession.report`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch.engine import validation as validate
from gradwatch.engine.distributed.collective import Collective, sharded
from gradwatch.engine.distributed.parameters import is_sharded, local_mask, local_shards, lockstep
from gradwatch.engine.distributed.whole import Whole, made_whole
from gradwatch.engine.function.conditions import warnings_withheld
from gradwatch.engine.function.evaluation import LossFn
from gradwatch.engine.function.held import HeldDetaches
from gradwatch.engine.function.optimizers import check_optimizers
from gradwatch.engine.function.state import TrainingState
from gradwatch.engine.function.surrogates import (
    StockSurrogates,
    as_autograd_sees_them,
    find_stock_surrogates,
    quantisers_as_identity,
)
from gradwatch.engine.function.torch_warnings import incorrect_gradient_notes
from gradwatch.engine.results.findings import FINDINGS, AppliedFindings
from gradwatch.engine.results.kinds import Verdict
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.numerics import Numerics, current_numerics
from gradwatch.engine.results.report import CheckReport, Probe, UnrestoredStateWarning
from gradwatch.engine.selection import checked_parameters
from gradwatch.engine.settings import ProbeSettings, settings_of

__all__ = ["CheckSession"]


@dataclasses.dataclass
class CheckSession:
    """One check's arguments, parameters, state and notes, from its start to its report (see the module doc): the
    validated ``model``, ``step``, ``settings`` and ``optimizers`` (whose state the check puts back), the model's stock
    ``surrogates``, when it ``started`` (``time.perf_counter()``), the ``params`` it probes (after :meth:`select`; local
    shards when sharded) and the ``collective`` of a sharded check (``None``: not sharded), the ``leading`` notes a
    report gives before the measurements' own and the ``trailing`` ones after, the training ``state`` captured while
    :meth:`measuring`, what it left ``unrestored``, the ``numerics`` it found, and the model made ``whole``
    (:func:`~gradwatch.engine.distributed.whole.made_whole`)."""

    model: nn.Module
    step: int
    settings: ProbeSettings
    optimizers: Sequence[torch.optim.Optimizer]
    surrogates: StockSurrogates
    started: float
    _: dataclasses.KW_ONLY
    whole: Whole
    params: list[tuple[str, Tensor]] = dataclasses.field(default_factory=list)
    collective: Collective | None = None
    leading: list[Note] = dataclasses.field(default_factory=list)
    state: TrainingState | None = None
    trailing: list[Note] = dataclasses.field(default_factory=list)
    unrestored: tuple[str, ...] = ()
    numerics: Numerics = dataclasses.field(default_factory=current_numerics)

    @classmethod
    @contextlib.contextmanager
    def open(
        cls,
        model: nn.Module,
        loss_fn: LossFn,
        *,
        step: int,
        settings: ProbeSettings | None,
        options: Mapping[str, Any],
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        gradients: Any = None,
        group: Any = None,
        applied: bool = False,
    ) -> Iterator[CheckSession]:
        """Validate what every check takes and start it, for the duration of the ``with`` block: ``settings`` whole,
        or ``options`` (some fields of :class:`~gradwatch.engine.settings.ProbeSettings`) one by one; a DeepSpeed or
        tensor-parallel model made whole (:func:`~gradwatch.engine.distributed.whole.made_whole`, with an applied
        check's ``gradients`` and ``group``: see :attr:`whole`), the check then run on the module it wraps.

        Raises:
            TypeError: ``model`` is not an ``nn.Module``, ``loss_fn`` is not callable, ``settings`` is no
                ``ProbeSettings``, an optimizer is no optimizer.
            ValueError: ``step`` or an option is out of range, or options are given both ways.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module; got {type(model).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"`loss_fn` must be callable as loss_fn(model, batch); got {type(loss_fn).__name__}")
        validate.check_int("step", step, minimum=0)
        chosen = settings_of(settings, options)
        protected = check_optimizers(optimizers)
        with made_whole(model, gradients, group, applied=applied) as whole:
            surrogates = find_stock_surrogates(whole.model)
            yield cls(whole.model, step, chosen, protected, surrogates, time.perf_counter(),
                      trailing=surrogates.notes(), whole=whole)  # fmt: skip

    def quantisers_as_identity(self) -> None:
        """Run the model's fake quantisers as the identity during the measurements (a recomputed check: see
        :mod:`~gradwatch.engine.function.surrogates`), and say so instead of what a check that keeps them says."""
        if self.surrogates.fake_quantisers and not self.surrogates.quantisers_off:
            self.surrogates.quantisers_off = True
            self.trailing = [note for note in self.trailing if note.code != NoteCode.FAKE_QUANTISATION]
            self.trailing += [note for note in self.surrogates.notes() if note.code == NoteCode.FAKE_QUANTISATION]

    def select(self, only: Collection[str] | None = None) -> list[tuple[str, Tensor]]:
        """The parameters the check probes (:func:`~gradwatch.engine.selection.checked_parameters`; of those, only
        the ones named in ``only`` when given), kept as :attr:`params`: under FSDP2 this rank's local shards of them,
        the session's :attr:`collective` then set and the surrogates' exempt coordinates cut to the shards."""
        params = checked_parameters(self.model, self.settings.ignore, self.surrogates.unprobed)
        if only is not None:
            params = [(name, p) for name, p in params if name in only]
        if params and is_sharded(params):
            self.collective, params = local_shards(params)
            shards = dict(params)
            self.surrogates.exempt = {name: local_mask(self.collective, mask, shards[name]) for name, mask in
                                      self.surrogates.exempt.items() if name in shards}  # fmt: skip
        self.params = params
        return params

    def held_detaches(self) -> HeldDetaches:
        """What an evaluator of this check holds of the values the loss detaches (a new one per evaluator): those of
        the loss's own code with ``hold_detached``, those of the DoRA modules always (see
        :mod:`gradwatch.engine.function.held`)."""
        outside = self.model if self.settings.hold_detached else None
        return HeldDetaches(outside=outside, inside=self.surrogates.weight_norms)

    @contextlib.contextmanager
    def measuring(self) -> Iterator[TrainingState]:
        """See :meth:`_measuring`; a recomputed check's fake quantisers run as the identity around it all."""
        with quantisers_as_identity(self.surrogates), self._measuring() as state:
            yield state

    @contextlib.contextmanager
    def _measuring(self) -> Iterator[TrainingState]:
        """The conditions of the check's measurements: the training state captured (and put back on leaving, whatever
        happens), the stock surrogates as autograd sees them, the sharded collective and FSDP's lockstep, the
        warnings the loss raises withheld. Afterwards the session knows what the loss changed and what could not be
        put back (warned about once, as an :class:`~gradwatch.engine.results.report.UnrestoredStateWarning`)."""
        state = self.state = TrainingState.capture(self.model, self.optimizers)
        with warnings_withheld() as withheld:
            try:
                with (
                    as_autograd_sees_them(self.surrogates),
                    sharded(self.collective),
                    lockstep(self.model, self.collective is not None),
                ):
                    yield state
            finally:
                state.restore()
        if withheld:
            self.trailing.append(
                Note(
                    NoteCode.WARNINGS_WITHHELD,
                    f"{len(withheld)} warning(s) raised during the check's evaluations were not shown, the first: "
                    f"{withheld[0]}",
                )
            )
            self.trailing += incorrect_gradient_notes(withheld)
        unrestorable = state.sandbox.unrestorable()  # a walk of the whole tree: once
        self.trailing += state.sandbox.notes(unrestorable) + state.guard.notes()
        self.unrestored = tuple(state.unrestorable(unrestorable))
        if self.unrestored:
            warnings.warn(
                f"gradwatch could not put back what the loss changed: {', '.join(self.unrestored)}; the model is not "
                "exactly as it was before the check (move that code out of loss_fn)",
                UnrestoredStateWarning,
                stacklevel=3,
            )

    def closing(self) -> list[Note]:
        """The notes a report ends with: how the model was made whole (none for a plain one)."""
        return [self.whole.note] if self.whole.note is not None else []

    def report(
        self, *, verdict: Verdict, probes: list[Probe], loss: float, notes: Sequence[Note] = (), **fields: Any
    ) -> CheckReport:
        """The check's report: the measurements' ``verdict``, ``probes``, ``loss``, ``notes`` and other ``fields``
        (see :class:`~gradwatch.engine.results.report.CheckReport`), with the session's step, duration, notes around the
        measurements' (each once), side effects and what could not be put back. The fields of
        :class:`~gradwatch.engine.results.findings.AppliedFindings` (``fault=``, ``noise_floor=``, ...) are nested in
        the report's ``applied``, which a check of another scope than ``"recomputed"`` always has."""
        fields.setdefault("n_forward", 0)
        fields.setdefault("n_backward", 0)
        found = {name: fields.pop(name) for name in FINDINGS if name in fields}
        if found or fields.get("scope", "recomputed") != "recomputed":
            fields["applied"] = AppliedFindings(**found)
        state = self.state
        return CheckReport(
            step=self.step,
            verdict=verdict,
            probes=probes,
            loss=loss,
            duration_s=time.perf_counter() - self.started,
            notes=[*dict.fromkeys([*self.leading, *notes, *self.trailing]), *self.closing()],
            side_effects=tuple(state.sandbox.changed + state.guard.changed) if state is not None else (),
            unrestored=self.unrestored,
            numerics=self.numerics,
            **fields,
        )
