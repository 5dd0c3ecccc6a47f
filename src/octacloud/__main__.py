"""``python -m octacloud``: the same as the ``octacloud`` console script."""

from octacloud.cli.main import main

main()
