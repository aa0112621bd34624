"""The adapters of the watch to training loops, imported only by those who use them (``import gradwatch`` imports
none of their frameworks; ``gradwatch.GradWatch`` imports Lightning when first used): :mod:`.lightning` for
Lightning's ``Trainer``; :mod:`.huggingface` for ``transformers.Trainer`` (with :mod:`.trainer_path`: how it trains
on a window, :mod:`.trainer_records`: what its ``compute_loss`` records, put back after a check); :mod:`.loggers`,
both trainers' loggers and where their records go; :mod:`.deepspeed` for DeepSpeed engines. Lightning Fabric,
Accelerate and plain loops need no adapter: they call :class:`gradwatch.GradientWatch` directly (``docs/loops.md``)."""
