"""A kspipe process's own life, whatever its workload or mode: its allocator settings, made
first thing by each entry point (:mod:`.memory`); how it stops on a signal or a
preemption (:mod:`.stopping`); and how far it got, for the launcher that watches it
(:mod:`.heartbeat`)."""
