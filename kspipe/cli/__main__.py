"""``python -m kspipe.cli``: the ``kspipe`` command, as ``python -m kspipe`` runs it."""

from kspipe.__main__ import main

if __name__ == "__main__":
    main()
