"""The ``gradwatch`` command line: ``gradwatch demo`` (:mod:`.demo`) and ``gradwatch report`` (:mod:`.reporting`),
dispatched by :func:`main` (:mod:`.main`)."""

from gradwatch.cli.main import main

__all__ = ["main"]
