"""The `sdserve` command line: one module per subcommand; ``main`` is the one place errors become exit codes."""
