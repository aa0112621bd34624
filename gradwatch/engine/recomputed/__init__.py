"""The recomputed check (:func:`gradwatch.check_gradients`), one measurement plan of the check session: the reference
gradient, the probes made and judged, their confirmations, the faithfulness of float64, user surrogates, compiled
modules."""
