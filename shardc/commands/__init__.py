"""The CLI's commands: one module per command group, each exporting ``COMMANDS`` (cli.py lists
them); ``output`` holds what they share (JSON output, rank flags, the error-to-flag table)."""

__all__ = ["build", "output", "plan", "runtime", "store", "verify"]
