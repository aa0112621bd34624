"""Measuring the loss along directions: the directions and displacements probes make (:mod:`.directions`), points
evaluated together in vectorised passes (:mod:`.vectorized`), and the service probes ask for points
(:mod:`.points`)."""
