"""The `tandem` command line: `cli.main` dispatches to one module per subcommand.

Importing it stays cheap: torch and Ray load only when a subcommand runs, never for `--help`.
"""
