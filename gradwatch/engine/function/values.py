"""What the user's loss returns and what autograd gives back, as the engine uses them."""

from __future__ import annotations

from torch import Tensor


def first_line(error: BaseException) -> str:
    """The first line of an error's message, cut to 200 characters: what a note quotes."""
    return str(error).split("\n", 1)[0][:200]


def listed(names: list[str], limit: int = 4) -> str:
    """The first ``limit`` of ``names``, joined, and how many more there are."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def dense(grad: Tensor | None) -> Tensor | None:
    """A gradient as a dense tensor: a sparse one (``nn.Embedding(sparse=True)``) is checked like any other, coordinates
    it leaves out being exactly zero."""
    if grad is None or not grad.is_sparse:
        return grad
    return grad.coalesce().to_dense()


def as_scalar_loss(value: object) -> Tensor:
    """``value`` as a 0-dim floating tensor, or a ``TypeError``/``ValueError`` saying why it is not a loss."""
    if not isinstance(value, Tensor):
        raise TypeError(f"loss_fn must return a scalar torch.Tensor; got {type(value).__name__}")
    if value.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar tensor; got a tensor of shape {tuple(value.shape)}")
    if not value.is_floating_point():
        raise ValueError(f"loss_fn must return a floating-point tensor; got dtype {value.dtype}")
    return value.reshape(())
