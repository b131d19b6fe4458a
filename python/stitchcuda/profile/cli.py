"""`stitchcuda profile` (placeholder)."""


def register(commands) -> None:
    """Adds the `profile` subcommand to the CLI's subparsers."""
