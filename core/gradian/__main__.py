"""``python -m gradian``: the same command line as the ``gradian`` script."""

from gradian.cli import main

main()
