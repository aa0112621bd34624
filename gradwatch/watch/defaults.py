"""The defaults of a series of checks, with their reasons: the cadence, the budget, the probe slice."""

DEFAULT_EVERY_N_STEPS = 500
"""The default cadence: a check every this many optimizer steps (besides the first, at step 1)."""

DEFAULT_PROBE_BATCH_SIZE = 2
"""The samples a check probes by default: two, so that code that mixes the samples of a batch (a backward that
averages over the whole batch instead of each sample, a ``.squeeze()`` that drops the batch dimension of one sample)
is checked as it runs in training; one sample hides such bugs."""

DEFAULT_MAX_OVERHEAD = 0.01
"""The default budget: checks take at most this fraction of the training time, so that the default cadence holds on
models whose check costs many training steps (a ResNet-18 on a CPU: about 8 steps per check)."""

DEFAULT_APPLIED_EVERY_N_STEPS = 5000
"""The default cadence of applied checks: every this many optimizer steps, and at the first check step (step 1), so a
fault on the training's path present from the start is found in the first minutes, as the recomputed check finds a
wrong formula. The first applied check is always made and measures what one costs; the later ones go within the 1%
budget (``max_overhead``) both kinds share, a due check postponed until the training time affords what the last one
cost (``benchmarks/applied.py`` measures the cost in training steps)."""
