"""``python -m trio_debounce``: the ``trio-debounce`` command line."""

from ._cli import main

main()
