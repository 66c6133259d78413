"""The CLI's commands: one module per command group, each exporting ``COMMANDS`` (cli.py lists
them); ``options`` holds the shared options (--json, --endpoint-url, --quiet), ``output`` what
they share at the end (the one printer, rank flags, the one error-field-to-flag table)."""

__all__ = ["build", "options", "output", "plan", "plan_emit", "reshard", "runtime", "store", "verify"]
