"""The Lightning adapter: :class:`GradWatch` turns a Trainer's hooks into checks of the engine and sends their reports
to the loggers and to the alert policy. It drives the watch; nothing below imports it."""

from gradwatch.integrations.lightning.callback import GradWatch

__all__ = ["GradWatch"]
