"""The descent of a culprit search (:mod:`.search`): from the loss down the call tree, one module at a time, each
step proved by activation probes (:mod:`.activations`); where a probe the descent needs cannot decide, a sweep of the
modules inside the deepest one proved (their own input probes, split by :mod:`.activations`); and the words that name
the culprit.
"""

from __future__ import annotations

from gradwatch.engine.culprits.activations import DOWNSTREAM, OWN, ActivationProbes, ExhaustedError
from gradwatch.engine.culprits.reads import within
from gradwatch.engine.culprits.sites import Site
from gradwatch.engine.culprits.words import CulpritWords, Localization, named
from gradwatch.engine.probing.search_budget import SearchBudget
from gradwatch.engine.results.notes import Note, NoteCode
from gradwatch.engine.results.report import SearchProgress


class Descent(CulpritWords):
    """The descent of :func:`~gradwatch.engine.culprits.search.localize` (see the module docs), writing into
    ``found``."""

    def __init__(
        self,
        sites: dict[str, Site],
        probes: ActivationProbes,
        failing_params: set[str],
        found: Localization,
        budget: SearchBudget | None = None,
    ) -> None:
        self.sites = sites
        self.probes = probes
        self.failing_params = failing_params
        self.found = found
        self.budget = budget
        self.proven: list[Site] = []  # modules proven to contain the bug, outermost first
        self.passed: set[str] = set()  # modules whose output gradient a split proved wrong: the boundary is after them
        self.resumed = False
        self._narrowed: tuple[str, ...] = budget.candidates if budget is not None else ()  # from an earlier search
        self._narrowing: tuple[Site | None, list[Site]] | None = None  # the children a binary search is narrowing
        self._start: tuple[tuple[str, ...], set[str]] = ((), set())  # where this check's search started
        probes.may_stop = self._narrowed_since_start

    def run(self) -> None:
        complete = False
        try:
            self._descend(self._resume())
            complete = True
        except ExhaustedError:
            self._stopped()
        self.found.progress = SearchProgress(
            complete, tuple(s.name for s in self.proven), () if complete else self._candidates(), self.resumed,
            self.probes.evaluations,
        )  # fmt: skip

    def _resume(self) -> Site | None:
        """Where the search starts: inside the deepest module an earlier check's search proved to hold the bug, if it
        still proves it, else from the loss (among the candidates left there, if the earlier search proved no module).
        The cap cannot stop the proof: it stops a search only once it narrowed the culprit further than it started."""
        within = self.budget.within if self.budget is not None else ()
        start = None
        self.probes.may_stop = lambda: False
        if within and all(name in self.sites for name in within):
            deepest = self.sites[within[-1]]
            if self._still_holds(deepest):
                self.proven, self.resumed, start = [self.sites[name] for name in within], True, deepest
        if within and not self.resumed:
            self._narrowed = ()
        self.resumed = self.resumed or bool(self._narrowed)
        self._start = (tuple(s.name for s in self.proven), set(self._narrowed or self._candidates()))
        self.probes.may_stop = self._narrowed_since_start
        return start

    def _narrowed_since_start(self) -> bool:
        """Whether the search narrowed the culprit since this check's search started: a module more proved to hold the
        bug, or fewer candidates left inside the deepest one."""
        path = tuple(s.name for s in self.proven)
        if len(path) != len(self._start[0]):
            return len(path) > len(self._start[0])
        return set(self._candidates()) < self._start[1]

    def _still_holds(self, site: Site) -> bool:
        """Whether the bug is proved inside ``site`` again: its output gradient right and its input gradient (or a
        parameter's inside it) wrong by its own backward; for the model itself, the outermost module, its output
        gradient right (the check failed: the bug is in the model, not in the loss's own code)."""
        if site.parent is None:
            return self._verdict(site, "activation") == "ok"
        return self._proved_inside(site) or self._leaf_own_parameters(site)

    def _candidates(self) -> tuple[str, ...]:
        """Where the bug still lies inside the deepest module proved: the children of its chain the binary search was
        narrowing (all of them before it started), and its sources (looked at after the chain)."""
        deepest = self.proven[-1] if self.proven else None
        chain, sources = self._children(deepest)
        if self._narrowing is not None and self._narrowing[0] is deepest:
            chain = self._narrowing[1]
        return tuple(site.name for site in [*chain, *sources])

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

    def _descend(self, node: Site | None = None) -> None:
        while True:
            chain, sources = self._children(node)
            j, settled = self._boundary(chain, node)
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
            if child is not None and entering == "fail":
                split = self.probes.split(child)
                if split == DOWNSTREAM and child.name not in self.passed:
                    # its backward passes on what reaches its output: that gradient is wrong after all (recorded)
                    self.passed.add(child.name)
                    continue
                if split != OWN:  # the split cannot tell
                    self._stop(node)
                    return
                self.proven.append(child)
                node = child
                continue
            source = self._failing_source(sources)
            if source is not None:  # out right, parameters inside wrong, no input gradient to tell by
                self.proven.append(source)
                node = source
                continue
            if child is not None and entering in ("ok", "inconclusive") and self._wrong_inside(child):
                # in and out right, but a gradient to parameters inside it is wrong there: its own code (a custom
                # Function between two of its children) or a child's
                self.proven.append(child)
                node = child
                continue
            if child is not None and entering != "ok" and self._leaf_parameters_wrong(child):
                # output gradient right, own parameters' gradient wrong as it uses them: the bug is in its backward,
                # whatever its undecided input gradient says (native probes of a float32-only kernel)
                self.proven.append(child)
                self._parameters_culprit(child)
                return
            if child is not None and child.name not in self.passed and self._verdict(child, "activation") == "fail":
                # its parameters' split proved its output gradient wrong: the boundary lies after it
                self.passed.add(child.name)
                continue
            if child is not None and entering != "ok":
                fed_wrong = j > 0 and self._verdict(chain[j - 1], "activation") == "fail"
                self._stop(node, first=child if fed_wrong else None)
                return
            if child is None and chain:
                self._after_last(node, chain[-1])
            elif child is not None and j > 0 and self._verdict(chain[j - 1], "activation") == "fail":
                if chain[j - 1].name in self.passed:  # inferred wrong, not measured: the next input probe may be the
                    self._stop(node, first=child)  # same error diluted (a query path beside key and value), no glue
                else:
                    self._between(node, chain[j - 1], child)
            else:
                self._parameters_only(node)
            return

    def _parallel_culprit(self, site: Site) -> bool:
        """Whether a module passes a wrong gradient to its input, its output gradient right and its own backward the
        cause (:func:`~.activations.own_share`)."""
        return (
            self._verdict(site, "module_input") == "fail"
            and self._verdict(site, "activation") == "ok"
            and self.probes.split(site) == OWN
        )

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

    def _wrong_inside(self, site: Site) -> bool:
        """Whether a failing parameter inside ``site`` has a wrong gradient as its own module uses it (a probe
        displacing it during that module's forward only fails): the error arises inside ``site``, not in a use of
        the parameter outside the modules."""
        if not site.children or not self._holds_failing_parameters(site):
            return False
        owners = self._owners([s for s in self.sites.values() if s is not site and within(s.name, site.name)])
        return any(self._verdict(owner, "module_params") == "fail" for owner in owners[:2])

    def _owners(self, inside: list[Site]) -> list[Site]:
        """The modules among ``inside`` that own a failing parameter, the last called first."""
        owned = {f"{s.name}.{n}" if s.name else n: s for s in inside for n in s.parameters}
        return sorted(
            {owned[p].name: owned[p] for p in self.failing_params if p in owned}.values(), key=lambda s: -s.order
        )

    def _holds_failing_parameters(self, site: Site) -> bool:
        prefix = f"{site.name}." if site.name else ""
        return any(name.startswith(prefix) for name in self.failing_params)

    def _boundary(self, children: list[Site], node: Site | None = None) -> tuple[int, bool]:
        """The first child from which on every output gradient is right: a binary search over the children whose probes
        decide; and whether it is settled (``False`` where the boundary lies among undecided children, the first child
        known right returned). A resumed search starts from the range an earlier check's search narrowed it to."""
        low, high = self._resumed_range(children, node)
        undecided: set[int] = set()
        while low < high:
            self._narrowing = (node, children[low:high])
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
        self._narrowing = (node, children[low : low + 1])  # the first child right: the bug inside it, or before it
        return low, True

    def _resumed_range(self, children: list[Site], node: Site | None) -> tuple[int, int]:
        """The range of the node's chain the boundary lies in: all of it, or, once, where an earlier search left it
        (empty where it left only the node's sources)."""
        narrowed, self._narrowed = self._narrowed, ()
        if not narrowed:
            return 0, len(children)
        names = [c.name for c in children]
        inside = [names.index(n) for n in narrowed if n in names]
        if inside:
            return min(inside), max(inside) + 1
        sources = {s.name for s in self._children(node)[1]}
        if set(narrowed) <= sources:
            return len(children), len(children)
        return 0, len(children)

    def _parameters_only(self, node: Site | None) -> None:
        """No gradient through the modules is wrong: look at the owners of the failing parameters."""
        owners = self._owners([s for s in self.sites.values() if node is None or within(s.name, node.name)])
        for owner in owners:
            if self._parameters_wrong(owner) and self._verdict(owner, "activation") in ("ok", None):
                self.proven.append(owner)
                self._parameters_culprit(owner)
                return
        fed = [
            o for o in owners if o.name != (node.name if node else None) and self._verdict(o, "activation") == "fail"
        ]
        if fed:  # the gradient reaching an owner's output is wrong, the node's is right: the node's own code after it
            after = named(fed[0])
            if node is None:
                self._culprit(
                    None,
                    f"the loss's own backward is wrong after {after}: the gradient at its output is "
                    f"{self._off(fed[0], 'activation')} off",
                )
            else:
                self._culprit(node, self._own_words(node, f" after {after}"))
            return
        if owners and any(self._verdict(o, "module_params") != "ok" for o in owners):
            # an owner's probe could not decide whether its parameters' gradients are right inside it: nothing is
            # proved outside the modules either
            self._stop(node)
            return
        if owners:
            names = ", ".join(named(o) for o in owners[:4])
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
            self._culprit(node, self._own_words(node, " outside its submodules"))

    def _leaf_parameters_wrong(self, site: Site) -> bool:
        """Whether ``site`` has no child and a probe of its own failing parameters fails."""
        owns = not site.children and self._holds_failing_parameters(site)
        return owns and self._parameters_wrong(site)

    def _leaf_own_parameters(self, site: Site) -> bool:
        """:meth:`_leaf_parameters_wrong`, its own backward proved the cause (:func:`~.activations.own_share`)."""
        return self._leaf_parameters_wrong(site) and self.probes.split(site, "module_params") == OWN

    def _parameters_wrong(self, owner: Site) -> bool:
        """Whether the probe of ``owner``'s own parameters fails, and not merely because the gradient reaching its
        output is wrong (:func:`~.activations.own_share`; that gradient is then recorded wrong)."""
        return (
            self._verdict(owner, "module_params") == "fail" and self.probes.split(owner, "module_params") != DOWNSTREAM
        )

    def _sweep(self, node: Site | None) -> Site | None:
        """The first module inside ``node``, breadth first along the calls, whose output gradient is right and whose
        input gradient is wrong (or a parameter inside it, as its own module uses it): the bug is inside it. The error's
        share of a gradient many modules feed is too small to steer the descent, while the input gradient of the module
        with the bug holds it undiluted (a 3% error in a LoRA layer's input gradient: 0.03% of its decoder layer's,
        about 1% of the layer's own). The modules inside a victim (its output gradient measured wrong) that run only
        during its one call are passed over: their backward cannot have made that gradient wrong, and probing them
        spent the budget upstream of the bug."""
        level = node.children if node is not None else [n for n, s in self.sites.items() if s.parent is None]
        while level:
            victims = set()
            for name in level:
                site = self.sites[name]
                # a module whose output gradient is wrong is a victim, whatever its input gradient; and every module
                # inside it too where none runs again after it returns (a wrong gradient there arises downstream)
                if not self._victim(site) and (self._proved_inside(site) or self._leaf_own_parameters(site)):
                    return site
                if self._victim(site):
                    victims.add(name)
            level = [
                child
                for name in level
                if not (name in victims and self._runs_once(self.sites[name]))
                for child in self.sites[name].children
            ]
        return None

    def _victim(self, site: Site) -> bool:
        """Whether the probe of the site's output gradient was measured and failed (nothing is spent)."""
        known = self.probes.known(site, "activation")
        return known is not None and known.verdict == "fail"

    def _runs_once(self, site: Site) -> bool:
        """Whether the forward calls ``site`` once and the modules inside it only during that call: their backward
        then runs after the gradient at the site's output is complete, and cannot make it wrong."""
        return site.calls == 1 and all(self._stays_inside(self.sites[child]) for child in site.children)

    def _stays_inside(self, site: Site) -> bool:
        return not site.strays and all(self._stays_inside(self.sites[child]) for child in site.children)

    def _stop(self, node: Site | None, first: Site | None = None) -> None:
        """A probe the descent needs could not decide: go on from a module inside the node that proves the bug inside
        it by its own probes (:meth:`_sweep`), or name the deepest module proven, if any. ``first`` (the boundary: a
        child whose output gradient is right, the child before it wrong, its input probe undecided) is swept first:
        swept with the rest, the budget went to the victims upstream."""
        for start, entered in ([(first, [first])] if first is not None else []) + [(node, [])]:
            inside = self._sweep(start)
            if inside is not None:
                self.proven += [*entered, inside]
                # a leaf whose own backward gives its parameters a wrong gradient, its output probes undecided (a
                # float32-only kernel probed natively) is the culprit
                (self._parameters_culprit if self._leaf_own_parameters(inside) else self._descend)(inside)
                return
        if node is not None:
            self._culprit(node, self._own_words(node, ""))
            self.found.notes.append(
                Note(NoteCode.CULPRIT_UNDECIDED, "culprit search stopped: a probe inside it could not decide")
            )
