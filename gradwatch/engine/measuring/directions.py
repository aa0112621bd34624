"""The directions a probe moves the parameters or inputs along, and the displacements they produce.

A probe perturbs either one coordinate (of a parameter, or of a floating input through the evaluator's working copy,
:class:`CoordinateDirection`) or several tensors at once along a unit vector (the descent, tensor, random and
input-direction probes, :class:`VectorDirection`). At each point a direction reports the displacement that float
arithmetic actually produced along it and autograd's first-order prediction of the loss change for that displacement
(:class:`Displacement`); :mod:`gradwatch.engine.numerics` turns the loss values and displacements into a verdict.

Perturbed values are always restored by copying the saved originals back, inside ``finally``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from gradwatch.engine.distributed.collective import layout, summed
from gradwatch.engine.function.copies import kept_copy
from gradwatch.engine.function.precision import exact_source
from gradwatch.engine.numerics.norms import CHUNK_ELEMENTS, dot, total

KEPT_COPY_ELEMENTS = 2**20
"""A direction over at most this many elements (8 MiB in float64) keeps its copy of the tensors and its cast components
from one move to the next (a small model's probes are dominated by such per-move work); a larger one makes them for
each move and frees them after (a large model's check would otherwise hold several copies of it)."""


@dataclass(frozen=True)
class Displacement:
    """Where a perturbation actually landed: ``along`` is the displacement's component along the intended direction,
    ``predicted`` autograd's first-order loss change ``g · δ`` for the whole displacement ``δ``."""

    along: float
    predicted: float


class _Moving:
    """What every direction derives from its :meth:`moving`."""

    def moving(self) -> AbstractContextManager[Callable[[float], Displacement]]:
        raise NotImplementedError

    @contextmanager
    def displaced(self, offset: float) -> Iterator[Displacement]:
        """Move by ``offset`` along the direction (rounded to the dtype); yield the displacement obtained."""
        with self.moving() as move:
            yield move(offset)


class CoordinateDirection(_Moving):
    """One coordinate ``tensor[index]`` of a parameter or a working input, whose analytic derivative is ``gradient``
    (0 when autograd gave none); ``after_write`` is called after every write (the evaluator tracks in-place changes
    of its inputs). In a sharded check ``index`` is global and ``tensor`` a shard: the rank that holds the coordinate
    moves it, the others move nothing."""

    def __init__(
        self,
        tensor: Tensor,
        index: tuple[int, ...],
        gradient: float,
        after_write: Callable[[], None] | None = None,
    ) -> None:
        self.tensor = tensor
        self.index = index
        self.analytic = gradient
        found = layout(tensor)
        self._local = index if found is None else found.local_index(index)  # None: another rank's shard holds it
        self.value = tensor.detach()[self._local].clone() if self._local is not None else tensor.new_zeros(())
        self._after_write = after_write

    @property
    def magnitude(self) -> float:
        """``|value|``, the same on every rank of a sharded check."""
        return summed([self.value.abs().item()])[0]

    @property
    def tensors(self) -> list[Tensor]:
        return [self.tensor]

    @contextmanager
    def moving(self) -> Iterator[Callable[[float], Displacement]]:
        """Yield ``move(offset)``, which sets the coordinate to ``value + offset`` and returns the displacement;
        restored on leaving."""

        def move(offset: float) -> Displacement:
            moved, displacement = self._moved(offset)
            self._write(moved)
            return displacement

        try:
            yield move
        finally:
            self._write(self.value)

    writes_whole_rows = False
    """:meth:`displace_rows` writes only the coordinate: its rows must hold copies of the tensor beforehand."""

    def displace_rows(self, offsets: Sequence[float], rows: Mapping[int, Tensor]) -> list[Displacement]:
        """Write the coordinate displaced by each offset into one row of ``rows[id(tensor)]`` (copies of the tensor
        stacked along a new leading dimension, one per offset), instead of moving the tensor."""
        moved = [self._moved(offset) for offset in offsets]
        with torch.no_grad():
            every_row: tuple[slice | int, ...] = (slice(None), *self.index)
            rows[id(self.tensor)][every_row] = torch.stack([value for value, _ in moved])
        return [displacement for _, displacement in moved]

    def _moved(self, offset: float) -> tuple[Tensor, Displacement]:
        """The value ``value + offset`` as represented in the tensor's dtype, and the displacement that is."""
        origin = self.value.double()
        moved = (origin + offset).to(self.tensor.dtype)
        actual = summed([(moved.double() - origin).item() if self._local is not None else 0.0])[0]
        return moved, Displacement(actual, self.analytic * actual)

    def substitute(self, replacements: Mapping[int, Tensor]) -> None:
        """Move, from now on, the tensor standing in for ours (keyed by ``id``), e.g. its float64 copy."""
        self.tensor = replacements.get(id(self.tensor), self.tensor)

    def _write(self, value: Tensor) -> None:
        if self._local is None:
            return
        with torch.no_grad():
            self.tensor[self._local] = value
        if self._after_write is not None:
            self._after_write()


class VectorDirection(_Moving):
    """Several tensors moved together along ``v = coefficient · (weight_T · component_T)_T``, a unit vector over all of
    them (the descent probe: ``components`` the gradients, ``coefficient = 1/‖g‖``; a cover probe: weighted gradients,
    no copy of them); the analytic slope is ``g · v``.

    While it moves the tensors it holds a copy of their original values (every restore is an exact copy; the check's
    guard's copy of a parameter where it holds one with the same bits) and its components in the tensors' dtypes.
    Over more than :data:`KEPT_COPY_ELEMENTS` elements it frees both when the move ends (:meth:`moving`), so that a
    large model's probes hold one such copy at a time (in float64 each is twice the float32 parameters), and restores a
    float64 substitute from its parameter; a smaller one keeps them.

    ``tensors`` are parameters or working inputs of the evaluator, ``grads`` autograd's gradient of each, ``weights`` a
    factor per tensor on its component (``None``: 1), ``after_write`` as for :class:`CoordinateDirection`.
    ``components_norm``: ``‖components‖`` in float64, when known; when ``components`` is ``grads`` it gives the analytic
    slope ``coefficient · ‖g‖²`` without another pass over the gradients. ``scales``: component ``T`` is
    ``components[T] * scales[T]``, made when used, one tensor at a time (a balanced probe's weighted gradients: no
    copy of the gradient held). ``slopes``: :meth:`slopes` of an equal direction made before (over other tensors
    of the same sizes: the float32 parameters, where these are their float64 copies), not computed again.
    """

    def __init__(
        self,
        tensors: Sequence[Tensor],
        components: Sequence[Tensor],
        grads: Sequence[Tensor],
        coefficient: float = 1.0,
        *,
        after_write: Callable[[], None] | None = None,
        components_norm: float | None = None,
        weights: Sequence[float] | None = None,
        scales: Sequence[float] | None = None,
        slopes: tuple[float, float] | None = None,
    ) -> None:
        self.tensors = list(tensors)
        self._components = list(components)
        self._scales = None if scales is None else list(scales)
        self.grads = list(grads)
        self.coefficient = coefficient
        self.weights = None if weights is None else list(weights)
        self._factors = self.weights or [1.0] * len(self.tensors)
        # v ∝ g (unweighted): the component along v is then g·δ/‖g‖
        self._along_gradient = (
            self.weights is None
            and self._scales is None
            and all(c is g for c, g in zip(self._components, self.grads, strict=True))
        )
        self._norm_squared: float | None = None  # ‖v‖², see _squared_norm
        self._large = sum(t.numel() for t in self.tensors) > KEPT_COPY_ELEMENTS
        self._made: list[Tensor] | None = None  # a small direction's components made with ``scales``, kept
        if slopes is not None:
            self.analytic, self._norm_squared = slopes
        elif components_norm is not None and self._along_gradient:
            self.analytic = coefficient * components_norm**2
        else:
            pairs = zip(self.grads, self._factors, strict=True)
            self.analytic = coefficient * total([w * self._dot(k, g) for k, (g, w) in enumerate(pairs)])  # g · v
        self._origin: list[Tensor] | None = None
        self._components_cast: list[Tensor] | None = None  # components in the dtypes of the tensors they move
        self._after_write = after_write

    def slopes(self) -> tuple[float, float]:
        """The analytic slope ``g · v`` and ``‖v‖²``, which depend on the components and gradients alone."""
        return self.analytic, self._squared_norm()

    @property
    def components(self) -> list[Tensor]:
        """The components, each made (with ``scales``: a copy of each, all at once)."""
        return [self._component(k) for k in range(len(self._components))]

    def _component(self, k: int) -> Tensor:
        """Component ``k``: with ``scales``, made anew for a large direction (one at a time), once for a small one."""
        scales = self._scales
        if scales is None:
            return self._components[k]
        if self._large:
            return self._components[k] * scales[k]
        if self._made is None:
            self._made = [c * w for c, w in zip(self._components, scales, strict=True)]
        return self._made[k]

    def _dot(self, k: int, other: Tensor | None) -> Tensor:
        """``other · c_k`` (``c_k · c_k`` for ``None``), a large direction's made component never made whole."""
        scale = self._scales[k] if self._scales is not None and self._large else None
        if scale is None:
            component = self._component(k)
            return dot(component if other is None else other, component)
        raw = self._components[k]
        return dot(raw, raw, a_scale=scale, b_scale=scale) if other is None else dot(other, raw, b_scale=scale)

    def substitute(self, replacements: Mapping[int, Tensor]) -> None:
        """As :meth:`CoordinateDirection.substitute`, for each tensor."""
        self.tensors = [replacements.get(id(t), t) for t in self.tensors]
        self._origin = None
        self._components_cast = None

    @contextmanager
    def moving(self) -> Iterator[Callable[[float], Displacement]]:
        """Yield ``move(offset)``, which moves every tensor to ``origin + offset · v`` (rounded to its dtype) and
        returns the displacement; restored on leaving."""
        # a float64 substitute is restored from its parameter (exact in float64): no float64 copy of the model kept
        if self._origin is None:
            self._origin = [_origin_of(t, self._large) for t in self.tensors]
        origin = self._origin
        intended = all(t.dtype == torch.float64 for t in self.tensors)

        def move(offset: float) -> Displacement:
            with torch.no_grad():
                displacement = self._move_as_intended(offset) if intended else self._move_and_measure(offset)
            if self._after_write is not None:
                self._after_write()
            return displacement

        try:
            yield move
        finally:
            with torch.no_grad():
                for tensor, saved in zip(self.tensors, origin, strict=True):
                    tensor.copy_(saved)
            if self._large:  # freed between moves: see the class doc
                self._origin = self._components_cast = None
            del origin
            if self._after_write is not None:
                self._after_write()

    writes_whole_rows = True
    """:meth:`displace_rows` writes every element of its rows."""

    def displace_rows(self, offsets: Sequence[float], rows: Mapping[int, Tensor]) -> list[Displacement]:
        """As :meth:`CoordinateDirection.displace_rows` (float64 rows), one broadcast operation per tensor for all
        offsets; the displacements taken as intended (:meth:`_move_as_intended`)."""
        factors = torch.tensor(
            [offset * self.coefficient for offset in offsets], dtype=torch.float64, device=self.tensors[0].device
        )
        with torch.no_grad():
            cast = self._cast_components() if not self._large else None
            for k, (tensor, weight) in enumerate(zip(self.tensors, self._factors, strict=True)):
                shaped = factors.to(tensor.device).view(len(offsets), *([1] * tensor.dim()))  # no copy on one device
                # a large direction: one tensor's component and cast at a time
                increment = cast[k] if cast is not None else self._component(k).to(tensor.dtype)
                torch.addcmul(tensor, shaped if weight == 1.0 else shaped * weight, increment, out=rows[id(tensor)])
        return [Displacement(offset * self._squared_norm(), offset * self.analytic) for offset in offsets]

    def _cast_components(self) -> list[Tensor]:
        if self._components_cast is None:
            self._components_cast = [self._component(k).to(t.dtype) for k, t in enumerate(self.tensors)]
        return self._components_cast

    def _move_and_measure(self, offset: float) -> Displacement:
        """Move the tensors; measure the displacement their dtype's rounding actually produced."""
        assert self._origin is not None
        along_is_predicted = self._along_gradient  # the component along v is then g·δ/‖g‖
        predicted_terms: list[Tensor] = []
        along_terms: list[Tensor] = []
        cast = None if self._large and self._scales is not None else self._cast_components()
        moving = zip(self.tensors, self._origin, self.grads, self._factors, strict=True)
        for k, (tensor, origin, grad, weight) in enumerate(moving):
            component = self._component(k)  # a large direction's made components: one tensor's at a time
            increment = component.to(tensor.dtype) if cast is None else cast[k]
            # in the tensor's own dtype: δ = moved − origin is then the displacement the rounding produced
            moved = torch.add(origin, increment, alpha=offset * self.coefficient * weight)
            tensor.copy_(moved)
            delta = moved.sub_(origin)
            predicted_terms.append(dot(grad, delta))
            if not along_is_predicted:
                along_terms.append(weight * dot(component, delta))
        # one host transfer for all tensors (a device sync per tensor would dominate a GPU probe)
        predicted = total(predicted_terms)
        return Displacement(self.coefficient * (predicted if along_is_predicted else total(along_terms)), predicted)

    def _move_as_intended(self, offset: float) -> Displacement:
        """Move float64 tensors to ``origin + offset · v``, whose rounding puts a displacement ~1e-12 of the step off
        the intended one, and take the intended one: ``v·δ = offset·‖v‖²`` along ``v`` (what the measuring path
        computes) and ``g·δ = offset·g·v`` predicted."""
        assert self._origin is not None
        if not self._large:
            moving = zip(self.tensors, self._origin, self._cast_components(), self._factors, strict=True)
            for tensor, origin, increment, weight in moving:
                torch.add(origin, increment, alpha=offset * self.coefficient * weight, out=tensor)
            return Displacement(offset * self._squared_norm(), offset * self.analytic)
        for k, (tensor, origin, weight) in enumerate(zip(self.tensors, self._origin, self._factors, strict=True)):
            # in place on the float64 tensor: the sum is computed in float64 whatever the dtypes of the origin (its
            # parameter) and the component, and no float64 copy of either is made whole (:func:`_add_chunked`)
            tensor.copy_(origin)
            scale = self._scales[k] if self._scales is not None else None
            _add_chunked(tensor, self._components[k], scale, offset * self.coefficient * weight)
        return Displacement(offset * self._squared_norm(), offset * self.analytic)

    def _squared_norm(self) -> float:
        if self._norm_squared is None:
            if self._along_gradient:  # v = g / ‖g‖: ‖v‖² = g·v / ‖g‖, already known
                self._norm_squared = self.coefficient * self.analytic
            else:
                terms = [w * w * self._dot(k, None) for k, w in enumerate(self._factors)]
                self._norm_squared = self.coefficient**2 * total(terms)
        return self._norm_squared


def _add_chunked(tensor: Tensor, component: Tensor, scale: float | None, alpha: float) -> None:
    """``tensor += alpha · component · scale`` (``scale`` ``None``: 1) a chunk of :data:`CHUNK_ELEMENTS` at a time where
    both are contiguous, so that the float64 copy an add makes of a float32 component (and the scaled component) is a
    chunk's, not the tensor's; elementwise, so the same bits (chunks start at multiples of the vector width)."""
    flat_ok = tensor.is_contiguous() and component.is_contiguous() and tensor.shape == component.shape
    if not flat_ok or tensor.numel() <= CHUNK_ELEMENTS or type(tensor) is not Tensor or type(component) is not Tensor:
        tensor.add_(component if scale is None else component * scale, alpha=alpha)
        return
    flat, source = tensor.view(-1), component.reshape(-1)
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        part = source[start : start + CHUNK_ELEMENTS]
        flat[start : start + CHUNK_ELEMENTS].add_(part if scale is None else part * scale, alpha=alpha)


def _origin_of(tensor: Tensor, large: bool) -> Tensor:
    """What a moved tensor is restored from: for a large direction, the parameter a float64 substitute was copied from;
    a parameter the check's guard holds a copy of with the same bits, that copy (no second one); else a copy."""
    source = exact_source(tensor) if large else None
    if source is not None:
        return source.detach()
    kept = kept_copy(tensor)
    return kept if kept is not None else tensor.detach().clone()


class HookedDirection(_Moving):
    """A displacement only the forward pass sees (a module's output, its inputs, or its parameters during its own call:
    :mod:`gradwatch.engine.culprits`), along a unit vector the owner's hooks add ``offset ×`` of; ``set_offset`` sets
    the offset they read (0 turns them off), ``analytic`` is autograd's derivative along it."""

    def __init__(self, analytic: float, set_offset: Callable[[float], None]) -> None:
        self.analytic = analytic
        self._set_offset = set_offset

    @contextmanager
    def moving(self) -> Iterator[Callable[[float], Displacement]]:
        """Yield ``move(offset)``, which makes the hooks add ``offset ×`` the direction; off on leaving."""

        def move(offset: float) -> Displacement:
            self._set_offset(offset)
            return Displacement(offset, offset * self.analytic)

        try:
            yield move
        finally:
            self._set_offset(0.0)

    def substitute(self, replacements: Mapping[int, Tensor]) -> None:
        """Nothing to substitute: the hooks displace whatever tensors the forward computes."""


Direction = CoordinateDirection | VectorDirection | HookedDirection
