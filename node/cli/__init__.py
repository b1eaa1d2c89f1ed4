"""cli/: the command line (`swarmrl ...`): parser and commands, argument checks, status printing."""
