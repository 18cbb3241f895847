"""The error a subcommand raises for a failure the user can act on."""

from __future__ import annotations


class CliError(Exception):
    """A failure the user can act on; printed as one line."""
