"""The loss as one deterministic function of the parameters and the batch's floating inputs: batch structure
(:mod:`.batch`), snapshot and exact restore of the training state (:mod:`.state`), the conditions every evaluation runs
under (:mod:`.conditions`), float64 reductions and storage (:mod:`.reductions`, :mod:`.precision`) and the evaluator
that computes the reference gradient and the perturbed losses (:mod:`.evaluation`)."""
