"""The `remat` command line: one module per subcommand, `main` lists them."""

from remat.cli.main import COMMANDS, main

__all__ = ["COMMANDS", "main"]
