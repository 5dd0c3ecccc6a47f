"""The ``octacloud`` command line: thin commands that call public APIs."""
