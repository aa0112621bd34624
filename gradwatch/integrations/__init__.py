"""Adapters of the watch to other training loops, imported only by those who use them (``import gradwatch`` imports
none of their frameworks): :mod:`gradwatch.integrations.huggingface` for ``transformers.Trainer``, with what it knows
of the Trainer in :mod:`.trainer_path` (how it combines and computes the applied gradient), :mod:`.trainer_outputs`
(where its records go) and :mod:`.records` (what a trainer's ``compute_loss`` records, put back after a check);
:mod:`gradwatch.integrations.deepspeed` for DeepSpeed engines. Lightning Fabric, Accelerate and plain loops need no
adapter: they call :class:`gradwatch.GradientWatch` directly (see ``docs/loops.md``)."""
