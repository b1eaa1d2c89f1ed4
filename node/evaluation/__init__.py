"""evaluation/: held-out evaluation (`swarmrl eval`): single-turn accuracy and multi-turn episodes."""
