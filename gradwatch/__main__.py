"""``python -m gradwatch``: the ``gradwatch`` command (see :mod:`gradwatch.cli`)."""

import sys

from gradwatch.cli import main

sys.exit(main())
