"""The `mlcrun` command line (typer); one module per subcommand."""
