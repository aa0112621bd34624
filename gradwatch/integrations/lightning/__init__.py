"""The Lightning adapter: :class:`GradWatch` turns a Trainer's hooks into the watch's calls and gives the watch the
trainer's loggers as its sinks. It drives the watch; nothing below imports it."""

from gradwatch.integrations.lightning.callback import GradWatch

__all__ = ["GradWatch"]
