"""Probing: which probes a check makes (:mod:`.portfolio`), how each one escalates until it is settled
(:mod:`.ladder`), what they are asked to do as one object (:mod:`.plan`), the probe being measured (:mod:`.tasks`)
and the sampling of tensors and coordinates (:mod:`.sampling`)."""
