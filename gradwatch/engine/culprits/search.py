"""Name the module whose backward is wrong: a search along the modules the loss runs, on failing checks only.

A wrong backward makes every gradient upstream of it wrong, so a failing check's probes name the victims. The culprit
is the module at which the gradient turns wrong: autograd's gradient with respect to its output is right, and the one
it passes to its inputs (or gives its own parameters) is not. Activation probes (:mod:`.sites`) measure exactly that,
one place of one module at a time, with the verdict discipline of every probe (full stencils, a failure confirmed at a
second step).

The search descends the call tree, from the loss down (:func:`localize`). At each module whose output gradient is right
and whose input gradient is wrong, its children are taken in the order the forward ran them; the gradient at their
outputs is wrong up to some child and right from the next on (the error flows backwards), so a binary search over the
children finds the boundary in a logarithmic number of probes:

* the first child whose output gradient is right, but whose input gradient is wrong, contains the bug: descend into it;
* if its input gradient is right too, the gradient turns wrong between two children, in the module's own code (a
  ``.detach()`` or a custom ``autograd.Function`` called in its ``forward``): the module is the culprit;
* if every child's output gradient is wrong, the module's own code after its last child is; at the top, that is the
  loss itself (:data:`LOSS`);
* if no gradient through the children is wrong, only parameters' gradients are: the module owning them is the culprit
  if a probe of its parameters, displaced during its own forward only, fails (a wrong weight gradient, a gradient hook);
  if they are right there, the parameters are used outside their modules, by code whose gradient is missing.

``report.culprits`` lists the culprit and the modules proven to contain it, most specific first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

from gradwatch.engine.culprits.activations import ActivationProbes, ExhaustedError
from gradwatch.engine.culprits.sites import Site, record_sites
from gradwatch.engine.function.evaluation import LossEvaluator
from gradwatch.engine.function.precision import probe_precision
from gradwatch.engine.measuring.points import Measurements
from gradwatch.engine.numerics.steps import machine_epsilon
from gradwatch.engine.probing.ladder import Ladder
from gradwatch.engine.probing.portfolio import Portfolio
from gradwatch.engine.probing.tasks import ProbeTask
from gradwatch.engine.recomputed.faithfulness import UnfaithfulFloat64Error
from gradwatch.engine.recomputed.reference import reproduced_center
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import CheckAbandonedError

LOSS = "<loss>"
"""The culprit named when the loss function's own code (after the last module, or outside every module) is wrong."""

LadderFactory = Callable[[Measurements, float], Ladder]


@dataclass
class Localization:
    """What a culprit search found.

    Attributes:
        culprits: The culprit's name and those of the modules proven to contain it, most specific first (empty when
            no module could be singled out).
        message: The finding in words, leading with the culprit.
        tasks: The activation probes the search made, measured.
        notes: Why a search could not run or stopped short.
    """

    culprits: list[str] = field(default_factory=list)
    message: str = ""
    tasks: list[ProbeTask] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)


def localize(
    model: nn.Module,
    evaluator: LossEvaluator,
    portfolio: Portfolio,
    tasks: Sequence[ProbeTask],
    ladder: LadderFactory,
    precision: str,
) -> Localization | None:
    """Search for the culprit of a failing check (see the module doc); ``None`` when the check did not fail on a
    gradient probe. ``evaluator`` must be on the native parameters and inputs; it is again afterwards."""
    failing = [
        t
        for t in tasks
        if t.failed
        and t.kind.traits.starts_culprit_search
        and t.result is not None
        and t.result.reason != "imprecise"  # rounding of a correct formula (fail_on_imprecise): no backward to name
    ]
    if not failing:
        return None
    found = Localization()
    try:
        sites = record_sites(model, evaluator)
    except CheckAbandonedError:
        raise
    except Exception as error:
        refused = f"no culprit search: the loss cannot run with hooks on its modules ({error})"
        found.notes.append(Note(NoteCode.CULPRIT_HOOKS_REFUSED, refused))
        return found
    if not sites:
        found.notes.append(Note(NoteCode.CULPRIT_NO_MODULE, "no culprit search: the loss runs no module"))
        return found
    failing_params = {t.target for t in failing if t.kind.traits.one_tensor}
    try:
        with probe_precision(model, evaluator, precision) as (_, trial):
            native = portfolio.native_dtype
            compute = max((p.dtype for _, p in evaluator.params), key=machine_epsilon)
            reproduced = reproduced_center(evaluator, portfolio.reference, trial, native, compute)
            if reproduced is None:
                return found
            measurements = Measurements(evaluator, *reproduced)
            probes = ActivationProbes(sites, ladder(measurements, portfolio.reference.loss), portfolio, compute)
            found.tasks = probes.tasks  # the same list: filled as the search measures
            _Search(sites, probes, failing_params, found).run()
    except UnfaithfulFloat64Error as error:
        found.notes.append(
            Note(
                NoteCode.CULPRIT_FLOAT64_UNFAITHFUL, f"no culprit search: float64 evaluates another function ({error})"
            )
        )
    except CheckAbandonedError:
        raise
    except Exception as error:  # the search must never cost the check its verdict
        found.culprits, found.message = [], ""
        found.tasks = [task for task in found.tasks if task.result is not None]  # the probe it raised in is not one
        found.notes.append(
            Note(
                NoteCode.CULPRIT_ABANDONED,
                f"culprit search abandoned: the loss raised {type(error).__name__} under its hooks ({error})",
            )
        )
    return found


class _Search:
    """The descent of :func:`localize` (see the module doc), writing into ``found``."""

    def __init__(
        self, sites: dict[str, Site], probes: ActivationProbes, failing_params: set[str], found: Localization
    ) -> None:
        self.sites = sites
        self.probes = probes
        self.failing_params = failing_params
        self.found = found
        self.path: list[Site] = []  # modules proven to contain the bug, outermost first

    def run(self) -> None:
        try:
            self._descend()
        except ExhaustedError:
            spent = f"{len(self.probes.tasks)} activation probes, {self.probes.evaluations} loss evaluations"
            if self.path:
                deepest = self.path[-1]
                self._name(deepest, f"the search stopped at its budget ({spent}) inside `{deepest.name}`")
            self.found.notes.append(
                Note(
                    NoteCode.CULPRIT_PROBE_LIMIT,
                    f"culprit search stopped at its budget ({spent}): "
                    + (
                        f"`{self.path[-1].name}` is the deepest module proved to hold the bug"
                        if self.path
                        else "no module proved to hold the bug"
                    ),
                )
            )

    def _children(self, node: Site | None) -> tuple[list[Site], list[Site]]:
        """The node's children whose output can be displaced, in the order the forward ran them: the chain (a gradient
        flows through them to their inputs) and the sources (token embeddings, position tables, rotary tables: no
        floating input, or one autograd gives no gradient)."""
        names = node.children if node is not None else [n for n, s in self.sites.items() if s.parent is None]
        children = [self.sites[name] for name in names if self.sites[name].probeable("activation")]
        chain = [c for c in children if any(bool(g.any()) for g in c.gradients.get("module_input", []))]
        return chain, [c for c in children if c not in chain]

    def _verdict(self, site: Site, place: str) -> str | None:
        result = self.probes.verdict(site, place)
        return None if result is None else result.verdict

    def _descend(self) -> None:
        node: Site | None = None
        while True:
            chain, sources = self._children(node)
            j, settled = self._boundary(chain)
            if not settled and not (j < len(chain) and self._proved_inside(chain[j])):
                # the boundary lies among undecided children, unless the first child known right passes a wrong
                # gradient to its input or to parameters inside it (which proves the bug inside it, whatever the
                # children before it say)
                self._stop(node)
                return
            child = chain[j] if j < len(chain) else None
            if child is not None and self._verdict(child, "activation") != "ok":
                self._stop(node)
                return
            entering = None if child is None else self._verdict(child, "module_input")
            if child is not None and entering == "ok":
                # children that run side by side (an attention's query, key and value projections) are no chain: a
                # later child whose output gradient is right can still pass a wrong one to the same input
                child = next((c for c in chain[j + 1 :] if self._parallel_culprit(c)), child)
                entering = self._verdict(child, "module_input")
            if child is not None and entering == "fail" and self.probes.clean_failure(child):
                self.path.append(child)
                node = child
                continue
            source = self._failing_source(sources)
            if source is not None:  # out right, parameters inside wrong, no input gradient to tell by
                self.path.append(source)
                node = source
                continue
            if child is not None and entering in ("ok", "inconclusive") and self._wrong_inside(child):
                # in and out right, but a gradient to parameters inside it is wrong there: its own code (a custom
                # Function between two of its children) or a child's
                self.path.append(child)
                node = child
                continue
            if child is not None and entering != "ok" and self._leaf_parameters_wrong(child):
                # output gradient right, own parameters' gradient wrong as it uses them: the bug is in its backward,
                # whatever its undecided input gradient says (native probes of a float32-only kernel)
                self.path.append(child)
                self._parameters_culprit(child)
                return
            if child is not None and entering != "ok":
                self._stop(node)
                return
            if child is None and chain:
                self._after_last(node, chain[-1])
            elif child is not None and j > 0 and self._verdict(chain[j - 1], "activation") == "fail":
                self._between(node, chain[j - 1], child)
            else:
                self._parameters_only(node)
            return

    def _parallel_culprit(self, site: Site) -> bool:
        """Whether a child after the boundary gives its input a wrong gradient, its output gradient right."""
        return self._verdict(site, "activation") == "ok" and self.probes.clean_failure(site)

    def _proved_inside(self, site: Site) -> bool:
        """Whether the bug is proved inside ``site`` (its output gradient right): its input gradient is wrong, or a
        parameter inside it is, as its own module uses it."""
        return self._parallel_culprit(site) or (self._verdict(site, "activation") == "ok" and self._wrong_inside(site))

    def _failing_source(self, sources: list[Site]) -> Site | None:
        """The last source whose output gradient is right and inside which parameters fail."""
        for source in reversed(sources):
            if self._holds_failing_parameters(source) and self._verdict(source, "activation") == "ok":
                return source
        return None

    def _after_last(self, node: Site | None, last: Site) -> None:
        """Even the last child's output gradient is wrong: the node's own code after it (the loss, at the top)."""
        if node is None:
            self._culprit(
                None,
                f"the loss's own backward is wrong: the gradient at the output of `{last.name}` (`{last.kind}`) is "
                f"{self._off(last, 'activation')} off",
            )
        else:
            self._culprit(node, self._own_words(node, f" after `{last.name}`"))

    def _between(self, node: Site | None, before: Site, after: Site) -> None:
        """The gradient is right at ``after``'s input and wrong at ``before``'s output: the node's own code."""
        if node is None:
            self._culprit(
                None,
                f"the loss's own backward is wrong between `{before.name}` and `{after.name}`: the gradient at the "
                f"input of `{after.name}` is right, at the output of `{before.name}` "
                f"{self._off(before, 'activation')} off",
            )
        else:
            self._culprit(node, self._own_words(node, f" between `{before.name}` and `{after.name}`"))

    def _wrong_inside(self, site: Site) -> bool:
        """Whether a failing parameter inside ``site`` has a wrong gradient as its own module uses it (a probe
        displacing it during that module's forward only fails): the error arises inside ``site``, not in a use of
        the parameter outside the modules."""
        if not site.children or not self._holds_failing_parameters(site):
            return False
        inside = [s for s in self.sites.values() if s is not site and _within(s.name, site.name)]
        owned = {f"{s.name}.{n}" if s.name else n: s for s in inside for n in s.parameters}
        owners = sorted(
            {owned[p].name: owned[p] for p in self.failing_params if p in owned}.values(), key=lambda s: -s.order
        )
        return any(self._verdict(owner, "module_params") == "fail" for owner in owners[:2])

    def _holds_failing_parameters(self, site: Site) -> bool:
        prefix = f"{site.name}." if site.name else ""
        return any(name.startswith(prefix) for name in self.failing_params)

    def _boundary(self, children: list[Site]) -> tuple[int, bool]:
        """The first child from which on every output gradient is right (the error flows backwards): a binary search
        over the children whose probes decide, passing over the undecided ones; and whether it is settled (``False``
        where the boundary lies among undecided children, the first child known right returned)."""
        low, high = 0, len(children)
        undecided: set[int] = set()
        while low < high:
            open_ = [i for i in range(low, high) if i not in undecided]
            if not open_:
                return high, False
            middle = open_[len(open_) // 2]
            verdict = self._verdict(children[middle], "activation")
            if verdict == "fail":
                low = middle + 1
            elif verdict == "ok":
                high = middle
            else:
                undecided.add(middle)
        return low, True

    def _parameters_only(self, node: Site | None) -> None:
        """No gradient through the modules is wrong: look at the owners of the failing parameters."""
        inside = [site for site in self.sites.values() if node is None or _within(site.name, node.name)]
        owned = {f"{site.name}.{n}" if site.name else n: site for site in inside for n in site.parameters}
        owners = sorted(
            {owned[p].name: owned[p] for p in self.failing_params if p in owned}.values(), key=lambda s: -s.order
        )
        for owner in owners:
            if self._verdict(owner, "module_params") == "fail" and self._verdict(owner, "activation") in ("ok", None):
                self.path.append(owner)
                self._parameters_culprit(owner)
                return
        fed = [
            o for o in owners if o.name != (node.name if node else None) and self._verdict(o, "activation") == "fail"
        ]
        if fed:  # the gradient reaching an owner's output is wrong, the node's is right: the node's own code after it
            after = f"`{fed[0].name}`"
            if node is None:
                self._culprit(
                    None,
                    f"the loss's own backward is wrong after {after}: the gradient at its output is "
                    f"{self._off(fed[0], 'activation')} off",
                )
            else:
                self._culprit(node, self._own_words(node, f" after {after}"))
            return
        if owners:
            names = ", ".join(f"`{o.name}`" for o in owners[:4])
            if node is None:
                self._culprit(
                    None,
                    f"the loss uses the parameters of {names} outside their modules, and that use "
                    "gets no gradient or a wrong one: inside their modules their gradients are right",
                )
            else:
                self._culprit(node, self._own_words(node, f", which uses the parameters of {names} outside them"))
            return
        if node is not None:
            self._culprit(node, self._own_words(node, " before its first submodule"))

    def _leaf_parameters_wrong(self, site: Site) -> bool:
        """Whether ``site`` has no child and a probe of its own failing parameters, displaced during its forward only,
        fails."""
        owns = not site.children and self._holds_failing_parameters(site)
        return owns and self._verdict(site, "module_params") == "fail"

    def _parameters_culprit(self, owner: Site) -> None:
        self._culprit(
            owner,
            f"the backward of `{owner.name}` (`{owner.kind}`) is wrong: the gradient of its parameters is "
            f"{self._off(owner, 'module_params')} off while its output gradient is right",
        )

    def _own_words(self, node: Site, where: str) -> str:
        evidence = (
            f"its input gradient is {self._off(node, 'module_input')} off while its output gradient is right"
            if self._verdict(node, "module_input") == "fail"
            else "the gradient of its parameters is wrong while its output gradient is right"
        )
        named = f"`{node.name}`" if node.name else "the model"
        code = f" in its own code{where}" if where else ""
        if not node.children:
            code = ""
        return f"the backward of {named} (`{node.kind}`) is wrong{code}: {evidence}"

    def _off(self, site: Site, place: str) -> str:
        result = self.probes.verdict(site, place)
        return "?" if result is None else f"{result.rel_error:.1%}"

    def _culprit(self, site: Site | None, message: str) -> None:
        names = [LOSS] if site is None else [site.name]
        names += [s.name for s in reversed(self.path) if site is None or s.name != site.name]
        self.found.culprits = names
        self.found.message = message

    def _name(self, site: Site, why: str) -> None:
        self._culprit(site, f"the backward of `{site.name}` (`{site.kind}`) or of a module inside it is wrong ({why})")

    def _stop(self, node: Site | None) -> None:
        """A probe the descent needs could not decide: name the deepest module proven, if any."""
        if node is not None:
            self._culprit(node, self._own_words(node, ""))
            self.found.notes.append(
                Note(NoteCode.CULPRIT_UNDECIDED, "culprit search stopped: a probe inside it could not decide")
            )


def _within(name: str, ancestor: str) -> bool:
    return ancestor == "" or name == ancestor or name.startswith(f"{ancestor}.")
