"""Reptile few-shot meta-learning: programs (:mod:`.programs`), the training loop
(:mod:`.training`) and the workload plugin serving stages program to save (:mod:`.plugin`)."""
