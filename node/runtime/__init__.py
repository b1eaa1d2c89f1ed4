"""runtime/: what every role process shares: its config, signals and bounded exit, child processes,
SQLite files."""
