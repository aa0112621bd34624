"""The defaults of a series of checks, with their reasons: the cadence, the budget, the probe slice, the cap on a
failing check's culprit search."""

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

DEFAULT_MAX_CULPRIT_SEARCH_STEPS = 100
"""The default cap on a failing check's culprit search, in training steps at the run's mean step (by the watch's clock):
a search that would take longer stops, names the deepest module it proved to hold the bug, and the next failing check
goes on from there. Without a cap a 3% backward bug in one layer of a tiny Llama under the Trainer took its first
failing applied check 9 minutes on a loaded machine; 100 steps is about what a search of a small model costs
(``benchmarks/failing_check.py``); it never stops a search before ``MIN_CULPRIT_SEARCH_SECONDS``."""

MIN_CULPRIT_SEARCH_SECONDS = 30.0
"""The cap on a culprit search never stops one sooner than this: on a small model, whose training steps take
milliseconds, 100 steps are a second or less, and a search of a few seconds stalls nothing; its culprit is then named
at the first failing check, as without a cap. 30 s rather than less: on a machine shared with other jobs, a tiny
model's search takes several times its quiet time, and a floor of 10 s cut the demo's first applied search there."""
