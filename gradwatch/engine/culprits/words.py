"""The words of a culprit search (:mod:`.search`): what it found (:class:`Localization`) and the sentences that name the
culprit and its evidence, as the descent (:mod:`.descent`) concludes."""

from __future__ import annotations

from dataclasses import dataclass, field

from gradwatch.engine.culprits.activations import ActivationProbes
from gradwatch.engine.culprits.sites import Site
from gradwatch.engine.probing.search_budget import SearchBudget
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.results.naming import display_name, named_module
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import SearchProgress

LOSS = "<loss>"
"""The culprit named when the loss function's own code (after the last module, or outside every module) is wrong."""


def named(site: Site) -> str:
    """A site named with its module's class: ``\\`net[2]\\` (\\`Linear\\`)``."""
    return named_module(site.name, site.kind)


@dataclass
class Localization:
    """What a culprit search found.

    Attributes:
        culprits: The culprit's name and those of the modules proven to contain it, most specific first (empty when
            no module could be singled out).
        message: The finding in words, leading with the culprit.
        tasks: The activation probes the search made, measured.
        notes: Why a search could not run or stopped short.
        progress: How far the descent got (``None`` where it did not run), for the next check to resume.
    """

    culprits: list[str] = field(default_factory=list)
    message: str = ""
    tasks: list[ProbeTask] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    progress: SearchProgress | None = None


class CulpritWords:
    """The sentences of :class:`~gradwatch.engine.culprits.descent.Descent`, which gives the probes, the modules proved,
    what it found and its verdicts."""

    probes: ActivationProbes
    proven: list[Site]
    found: Localization

    budget: SearchBudget | None

    def _verdict(self, site: Site, place: str) -> str | None:
        raise NotImplementedError

    def _candidates(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _stopped(self) -> None:
        """The search ran out (its cap, or its limits): the deepest module proved named, with a note."""
        spent = f"{len(self.probes.tasks)} activation probes, {self.probes.evaluations} loss evaluations"
        if self.probes.capped:
            steps = f"{self.budget.steps:g} training steps" if self.budget is not None and self.budget.steps else "cap"
            spent = f"its cap of {steps}, {spent}"
        left = self._candidates()
        listed = ", ".join(f"`{display_name(n)}`" for n in left[:4]) + (", ..." if len(left) > 4 else "")
        after = f"; {len(left)} candidate(s) left: {listed}" if left and self.probes.capped else ""
        if self.proven:
            deepest = self.proven[-1]
            why = f"the search stopped at {'its budget (' + spent + ')' if not self.probes.capped else spent}"
            self._name(deepest, f"{why} inside `{display_name(deepest.name)}`{after}")
        elif self.probes.capped:
            self.found.message = f"the culprit search stopped at {spent} before proving a module holds the bug"
        code, what = (
            (NoteCode.CULPRIT_SEARCH_CAPPED, f"culprit search stopped at {spent}")
            if self.probes.capped
            else (NoteCode.CULPRIT_PROBE_LIMIT, f"culprit search stopped at its budget ({spent})")
        )
        self.found.notes.append(
            Note(
                code,
                f"{what}: "
                + (
                    f"{named(self.proven[-1])} is the deepest module proved to hold the bug"
                    if self.proven
                    else "no module proved to hold the bug"
                )
                + after
                + ("; the next failing check of a series goes on from there" if self.probes.capped else ""),
            )
        )

    def _after_last(self, node: Site | None, last: Site) -> None:
        """Even the last child's output gradient is wrong: the node's own code after it (the loss, at the top)."""
        if node is None:
            self._culprit(
                None,
                f"the loss's own backward is wrong: the gradient at the output of {named(last)} is "
                f"{self._off(last, 'activation')} off",
            )
        else:
            self._culprit(node, self._own_words(node, f" after {named(last)}"))

    def _between(self, node: Site | None, before: Site, after: Site) -> None:
        """The gradient is right at ``after``'s input and wrong at ``before``'s output: the node's own code."""
        if node is None:
            self._culprit(
                None,
                f"the loss's own backward is wrong between {named(before)} and {named(after)}: the gradient at "
                f"the input of `{display_name(after.name)}` is right, at the output of `{display_name(before.name)}` "
                f"{self._off(before, 'activation')} off",
            )
        else:
            self._culprit(node, self._own_words(node, f" between {named(before)} and {named(after)}"))

    def _parameters_culprit(self, owner: Site) -> None:
        read = [name for name in owner.parameters if "." in name]  # a module's own parameters have plain names
        whose = "its parameters" if not read else "the parameters it reads (" + ", ".join(f"`{n}`" for n in read) + ")"
        off, right = self._off(owner, "module_params"), self._verdict(owner, "activation") in ("ok", None)
        why = "while its output gradient is right" if right else "and disagrees with its forward"  # split: own
        self._culprit(owner, f"the backward of {named(owner)} is wrong: the gradient of {whose} is {off} off {why}")

    def _own_words(self, node: Site, where: str) -> str:
        evidence = (
            f"its input gradient is {self._off(node, 'module_input')} off while its output gradient is right"
            if self._verdict(node, "module_input") == "fail"
            else "the gradient of its parameters is wrong while its output gradient is right"
        )
        code = f" in its own code{where}" if where else ""
        if not node.children:
            code = ""
        return f"the backward of {named(node)} is wrong{code}: {evidence}"

    def _off(self, site: Site, place: str) -> str:
        result = self.probes.verdict(site, place)
        if result is None:
            return "?"
        # a formula fault within float32's tolerance, searched for in float64 (:mod:`..recomputed.formula`): 2e-05
        return f"{result.rel_error:.1%}" if result.rel_error >= 1e-3 else f"{result.rel_error:.1g}"

    def _culprit(self, site: Site | None, message: str) -> None:
        names = [LOSS] if site is None else [site.name]
        names += [s.name for s in reversed(self.proven) if site is None or s.name != site.name]
        self.found.culprits = names
        self.found.message = message

    def _name(self, site: Site, why: str) -> None:
        self._culprit(site, f"the backward of {named(site)} or of a module inside it is wrong ({why})")
