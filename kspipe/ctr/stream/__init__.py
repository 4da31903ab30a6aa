"""Day-by-day streams of PaddleRec's online layout (``ctr.stream``): the layout's days and
passes (:mod:`.layout`), the training loop (:mod:`.loop`) and its base and delta saves
(:mod:`.saves`).  docs/sparse-tables.md says how to run one."""
