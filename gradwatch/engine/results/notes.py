"""The remarks of a report (:attr:`CheckReport.notes <gradwatch.engine.results.report.CheckReport.notes>`) as data:
each a :class:`Note`, a ``str`` (its text, as users read it) with a stable :class:`NoteCode`, so that code and tests
ask ``note.code`` instead of searching the wording, and the wording can change without breaking them.

Every code the engine emits is a member of :class:`NoteCode`, with its one-line meaning (``NoteCode.X.meaning``).
"""

from __future__ import annotations

from collections.abc import Iterable

from gradwatch.engine.results.kinds import StrEnum


class NoteCode(StrEnum):
    """Every note's code, with what it means (``.meaning``)."""

    meaning: str

    def __new__(cls, code: str, meaning: str) -> NoteCode:
        member = str.__new__(cls, code)
        member._value_ = code
        member.meaning = meaning
        return member

    # the batch, the loss and its reference point
    SLICE_REFUSED = "slice-refused", "the loss raised on the probe slice of the batch"
    WHOLE_BATCH = "whole-batch", "probes use the whole batch because the loss refused a slice of it"
    NOT_REPRODUCIBLE = "not-reproducible", "no probe made: the loss draws randomness gradwatch cannot replay"
    AUTOGRAD_RECORDING = "autograd-recording", "evaluations run with autograd on: the loss differs under no_grad"
    NONFINITE_LOSS = "nonfinite-loss", "the loss is not finite at the point or around it: no derivative to compare"
    LOSS_NEAR_ZERO = "loss-near-zero", "no probe made: the loss is too close to zero for its gradient's rounding"
    NOTHING_TO_PROBE = "nothing-to-probe", "no probe made: no parameter to check and no input with a gradient"
    NO_TRAINABLE_PARAMETER = (
        "no-trainable-parameter",
        "the model has no trainable parameter: only the gradient in the batch's inputs was checked",
    )
    INPUT_PROBES_REFUSED = "input-probes-refused", "input probes skipped: the loss cannot be differentiated in inputs"
    INPUTS_DETACHED = "inputs-detached", "inputs the loss detaches are not probed: their gradient is not the derivative"
    BATCH_OPAQUE = "batch-opaque", "a tensor of the batch gradwatch cannot probe (in an opaque object, or complex)"
    DOUBLE_BACKWARD = "double-backward", "evaluations run with autograd on: the loss differentiates inside itself"
    DETACHED_HELD = "detached-held", "values the loss detaches held at the reference's: what autograd differentiates"
    DETACHED_MISMATCH = "detached-mismatch", "detached values could not be held: the loss detached other tensors"
    WARNINGS_WITHHELD = "warnings-withheld", "warnings raised during the check's evaluations were not shown"
    SILENTLY_INCORRECT = "silently-incorrect", "PyTorch warned that the loss's gradient may be silently incorrect"
    # the model's state
    STATE_RESTORED = "state-restored", "the loss changes the model's state, which the check put back"
    STATE_UNRESTORED = "state-unrestored", "the loss changed state in place that the check could not put back"
    MODEL_EDITED = "model-edited", "the loss changes the model itself (parameters, hooks, submodules); put back"
    EDITED_NOT_PROBED = "edited-not-probed", "parameters the loss changes itself are put back but not probed"
    INPUTS_REFUSED = "inputs-refused", "input probes skipped: the loss refuses displaced inputs (a target, a mask)"
    FOCUS_UNKNOWN = "focus-unknown", "names of `focus` that are no parameters of the model were left out"
    # tensors exempt or treated apart
    SPECTRAL_NORM = "spectral-norm", "spectral norms checked with their power iteration held constant"
    PADDING_EXEMPT = "padding-exempt", "padding rows of embeddings not probed (no gradient by design)"
    NOT_PROBED = "not-probed", "a parameter not probed, and why (its gradient is not the derivative by design)"
    FAKE_QUANTISATION = "fake-quantisation", "fake quantisation enabled: a piecewise-constant loss; inputs not probed"
    DORA_NORM = "dora-norm", "DoRA weight norms held constant during the check, as autograd treats them"
    # precision
    NATIVE_PRECISION = "native-precision", "probes run in the native precision: the loss refused float64"
    SIXTEEN_BIT_FLOOR = "sixteen-bit-floor", "a 16-bit model's tolerance, measured on its path or the fixed one"
    FLOAT64_UNFAITHFUL = "float64-unfaithful", "probes run natively: float64 evaluates another function"
    FLOAT64_CASTS_KEPT = "float64-casts-kept", "float64 probes keep the model's casts to a lower precision"
    FLOAT64_DRAWS_NATIVE = "float64-draws-native", "float64 probes make random draws in the native dtype, as training"
    FLOAT64_REDUCTIONS_OFF = (
        "float64-reductions-off",
        "float64 reductions switched off: one differed from the native result, or the loss raised",
    )
    FLOAT64_TOO_SLOW = "float64-too-slow", "probes run natively: float64 costs too much against the step on this device"
    # memory
    MEMORY_NATIVE = "memory-native", "probes run natively: float64 would not fit (or ran out) in the device's memory"
    OUT_OF_MEMORY = "out-of-memory", "the check ran out of memory: put back, inconclusive; the next runs cheaper"
    MEMORY_SHRUNK = "memory-shrunk", "the probe batch shrunk before the check: its estimated peak did not fit in memory"
    MEMORY_POSTPONED = "memory-postponed", "no probe made: the check's estimated peak does not fit in the free memory"
    REMEASURED_IN_FLOAT64 = "remeasured-in-float64", "undecided probes measured again in float64"
    NO_FLOAT64_REMEASUREMENT = "no-float64-remeasurement", "undecided probes could not be measured again in float64"
    # vectorised passes
    NOT_FLOAT64_UNVECTORISED = "unvectorised-not-float64", "points evaluated one by one: the probes are not float64"
    HOOKS_UNVECTORISED = "unvectorised-hooks", "points evaluated one by one: forward hooks would see the passes"
    IN_PLACE_UNVECTORISED = "unvectorised-in-place", "points evaluated one by one: the loss changes a tensor in place"
    NOT_VECTORISABLE = "unvectorised-refused", "points evaluated one by one: the loss cannot be vectorised"
    VECTORISED_MISMATCH = "unvectorised-mismatch", "points evaluated one by one: a vectorised pass gave another loss"
    # confirmation of failures
    SHIFT_UNMEASURED = "shift-unmeasured", "the failures could not be measured again at a shifted point"
    LOCALIZATION_BUDGET = "localization-budget", "tensors that looked wrong on a screen but were not measured further"
    SWEEP_CAPPED = "sweep-capped", "tensors not screened after a failure: the failing check's cap ran out"
    SHIFT_BUDGET = "shift-budget", "failures not measured again at a shifted point: more significant ones stood there"
    FLOAT64_UNFAITHFUL_THERE = "float64-unfaithful-there", "failures measured natively: float64 differs along them"
    FLOAT64_UNREPRODUCED = "float64-unreproduced", "a failure float64 finds is ok in the native precision: not reported"
    IMPRECISE_BEYOND_ROUNDING = "imprecise-beyond-rounding", "a native gradient is off by more than its rounding"
    FORMULA_UNCHECKED = "formula-unchecked", "a gradient within the tolerance could not have its formula checked"
    FORMULA_WRONG_BELOW_TOLERANCE = (
        "formula-wrong-below-tolerance",
        "a gradient within the tolerance is off by its formula, not its rounding: failed",
    )
    # the culprit search
    CULPRIT_HOOKS_REFUSED = "culprit-hooks-refused", "no culprit search: the loss cannot run with hooks on its modules"
    CULPRIT_NO_MODULE = "culprit-no-module", "no culprit search: the loss runs no module"
    CULPRIT_FLOAT64_UNFAITHFUL = "culprit-float64-unfaithful", "no culprit search: float64 evaluates another function"
    CULPRIT_ABANDONED = "culprit-abandoned", "culprit search abandoned: the loss raised under its hooks"
    CULPRIT_PROBE_LIMIT = "culprit-probe-limit", "culprit search stopped at its limit of probes"
    CULPRIT_SEARCH_CAPPED = "culprit-search-capped", "culprit search stopped at its cap; the next check goes on"
    CULPRIT_FLOAT32_TWIN = "culprit-float32-twin", "the culprit search ran on a float32 twin of the 16-bit model"
    CULPRIT_UNDECIDED = "culprit-undecided", "culprit search stopped: a probe inside it could not decide"
    UPSTREAM_IGNORED = "upstream-ignored", "a module's backward ignores its upstream gradient: right only at weight 1"
    # compiled graphs
    COMPILED_UNSUPPORTED = "compiled-unsupported", "compiled gradient not compared: needs torch >= 2.6"
    COMPILED_WOULD_RECOMPILE = "compiled-would-recompile", "compiled gradient not compared: the batch would recompile"
    COMPILED_LOSS_DIFFERS = "compiled-loss-differs", "compiled gradient not compared: its loss is not the eager one"
    # several processes
    SHARDED = "sharded", "one check of the global loss, run on shards by every rank together"
    SHARDED_NATIVE = "sharded-native", "float64 probes are not made on shards"
    RANKS_TOGETHER = "ranks-together", "the verdict of every rank, which ran one check of the global loss together"
    RANKS_SHARDS = "ranks-shards", "the verdict of every rank, each of which checked its own batch shard"
    LOSS_COLLECTIVES = "loss-collectives", "the loss calls collectives: checked as the global loss, every rank together"
    ZERO3_GATHERED = "zero3-gathered", "DeepSpeed ZeRO-3 parameters gathered whole on every rank for the check"
    TENSOR_PARALLEL = "tensor-parallel", "tensor-parallel parameters made whole on every rank for the check"
    LOSS_FOR_SHARDS = (
        "loss-for-shards",
        "no probe made: a tensor-parallel loss computes another value on whole parameters than on the shards",
    )
    RANKS_SPLIT = (
        "ranks-split",
        "the ranks hold different parameters (a split by hand): checked as one model against the summed loss",
    )
    REPLICAS_DISAGREE = (
        "replicas-disagree",
        "no probe made: tensor-parallel ranks on one batch differ in parameters or gradient",
    )
    # applied checks (gradwatch.engine.applied)
    APPLIED_FLOOR = "applied-floor", "the noise floor of the training's path the applied gradient was judged against"
    APPLIED_ROUNDING_CROSSING = (
        "applied-rounding-crossing",
        "a 16-bit path's disagreement gone at shifted points: its rounding crossed a kink, undecided",
    )
    APPLIED_UNCHECKED = "applied-unchecked", "trainable parameters without a gradient were not checked"
    APPLIED_NOT_REPRODUCIBLE = "applied-not-reproducible", "no probe made: the window's loss is not reproducible"
    APPLIED_PATH_DIFFERS = "applied-path-differs", "no probe made: the path computes another loss than eager code"
    APPLIED_NATIVE = "applied-native", "applied probes run natively: the loss refused float64"
    APPLIED_CLIPPING = "applied-clipping", "the clip coefficient the loop applied, against the verified gradient's norm"
    UPDATE_REFERENCE = "update-reference", "the reference an update check compared the optimizer's update with"
    UPDATE_UNRESOLVED = "update-unresolved", "an update the parameters' dtype rounds too coarsely to be checked"
    UPDATE_UNCHECKED = "update-unchecked", "a tensor an update check could not compare, and why"
    UPDATE_UNDECLARED_CLIP = "update-undeclared-clip", "a clip the loop applied but did not declare"
    UPDATE_RANKS = "update-ranks", "the ranks whose share of a sharded tensor's update is wrong"
    ACCUMULATION_EQUIVALENCE = (
        "accumulation-equivalence",
        "the accumulated gradient against the window's samples taken as one batch (scale, cosine)",
    )
    ACCUMULATION_UNEQUAL = (
        "accumulation-unequal",
        "the accumulated gradient is not the window's as one batch (a loss normalised per micro-batch)",
    )
    APPLIED_EDITED = "applied-edited", "no probe made: the loss changes parameters itself, away from training's point"
    APPLIED_COARSE_LOSS = (
        "applied-coarse-loss",
        "the loss's value is rounded coarser than the probes compute: probes stepped for its dtype",
    )
    APPLIED_UNRESOLVED = (
        "applied-unresolved",
        "probes whose noise is comparable to the slope they measure: undecided, never ok",
    )
    APPLIED_PATH_INFERRED = (
        "applied-path-inferred",
        "the path's autocast was inferred: the model enters it itself, or it reproduces the applied gradient",
    )
    APPLIED_CLOSER_LOOK_DEFERRED = (
        "applied-closer-look-deferred",
        "a first applied check made only its combined probes (they agree); its closer look waits for budget",
    )
    UNREACHED_PARAMETERS = (
        "unreached-parameters",
        "trainable parameters the loss never reaches: requires_grad, and no gradient after the backward",
    )
    # a watch's own calls outside a check (gradwatch.watch.guard)
    WATCH_ERROR = "watch-error", "a call gradwatch makes outside a check raised: skipped, training unaffected"


_BY_VALUE: dict[str, NoteCode] = {code.value: code for code in NoteCode}


class Note(str):
    """One remark of a report: its text, as users read it, with a stable :attr:`code`.

    A ``str``, so it prints, compares, hashes, joins and serialises as its text (``Note(code, "x") == "x"``); pickles
    and copies keep the code."""

    code: NoteCode

    def __new__(cls, code: NoteCode | str, text: str) -> Note:
        found = _BY_VALUE.get(code)
        if found is None:
            raise ValueError(f"`code` must be a NoteCode (gradwatch.engine.results.notes); got {code!r}")
        note = super().__new__(cls, text)
        note.code = found
        return note

    def __reduce__(self) -> tuple[type[Note], tuple[str, str]]:
        return (Note, (self.code.value, str(self)))


def codes(notes: Iterable[str]) -> list[NoteCode | None]:
    """The code of each note, in order (``None`` for a plain string)."""
    return [getattr(note, "code", None) for note in notes]
