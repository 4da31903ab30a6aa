"""Modes: how a job's processes are laid out and how their training is combined.

A mode is a plugin serving the ``role`` stage (``stages.role: ${mode}``).  Its role object
(:class:`kspipe.modes.role.Role` and subclasses) is the whole interface a workload sees:

=============  ==========================================================================
``local``      :mod:`kspipe.modes.local`: one process (or, isolated, one child process)
``pserver``    :mod:`kspipe.modes.pserver` + :mod:`kspipe.modes.ps.exchange`: parameter
               servers; the strategies' exchange; fleet's tables for dataset training
``collective`` :mod:`kspipe.modes.collective`: all-reduce ops in the programs, gloo on
               CPU, NCCL on GPU
=============  ==========================================================================

Where the command starts a job's processes the role stage returns a
:class:`kspipe.modes.job.ClusterJob`: the mode plans the processes, the process launcher
(``cluster.launcher``, :mod:`kspipe.launchers`) starts and watches them.
"""
