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
"""The default cadence of applied checks: every this many optimizer steps (and at the first check step).

An applied check evaluates the loss of the whole accumulation window 14-40 times (a full stencil along the applied
gradient, a screen per probed tensor) and runs 2-4 extra forward and backward passes of the window: measured by
``benchmarks/applied.py`` at 18-56 training steps on its small CPU models (about 25 typically). Every 5000 steps
that is about 0.5% of the training time, half of the 1% budget (``max_overhead``) the applied checks share with the
recomputed ones; the budget postpones what does not fit on models whose checks cost more, so the defaults stay
within 1% with both kinds on. The first check step (step 1 by default) is due for an applied check whatever the
cadence; under a budget it waits until the training time affords it (:data:`FIRST_APPLIED_ESTIMATE_STEPS`)."""

FIRST_APPLIED_ESTIMATE_STEPS = 25
"""What the first applied check of a run is taken to cost, in training steps, before one has measured it: the typical
cost ``benchmarks/applied.py`` measures on its CPU models (17-44). Under a budget the first applied check waits until
the training time affords that much (about 2,500 steps at 1%), a due check after it until the training time affords
what the last one cost; without a budget it runs when due."""
