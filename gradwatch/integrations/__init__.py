"""Adapters of the watch to other training loops, one module each, imported only by those who use them (``import
gradwatch`` imports none of their frameworks): :mod:`gradwatch.integrations.huggingface` for ``transformers.Trainer``,
:mod:`gradwatch.integrations.deepspeed` for DeepSpeed engines.
Lightning Fabric, Accelerate and plain loops need no adapter: they call :class:`gradwatch.GradientWatch` directly
(see ``docs/loops.md``)."""
