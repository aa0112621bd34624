"""Finite-difference numerics, free of any model: steps and tolerances by dtype (:mod:`.steps`), the stencil of a
probe and its residuals (:mod:`.stencil`), the verdicts a stencil supports (:mod:`.assessment`) and float64-accumulated
norms and dot products of tensors (:mod:`.norms`)."""
