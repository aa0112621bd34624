"""Train the example models with gradwatch on synthetic data, then print what it found and where the logs are.

    python examples/demo.py [--logdir gradwatch_logs] [--bug none --bug rmsnorm] [--steps 300] [--every 50]

The same program as ``gradwatch demo`` (its code is :mod:`gradwatch.cli.demo`). By default two runs: a healthy
classifier (BatchNorm, Dropout), where every check should pass, and a classifier whose custom autograd Function has a
subtly wrong backward, which gradwatch should flag at its first check (step 1). Exits with 0 when both outcomes are as
expected.
"""

import sys

from gradwatch.cli.demo import main

if __name__ == "__main__":
    sys.exit(main())
