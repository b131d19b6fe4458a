"""`stitchcuda check` (placeholder)."""


def register(commands) -> None:
    """Adds the `check` subcommand to the CLI's subparsers."""
