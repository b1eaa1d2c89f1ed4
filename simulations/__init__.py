"""Discrete-event simulations of the swarm (`swarmrl.simulations`).

They replay the product's own protocol and validator rules (`swarmrl.protocol`,
`swarmrl.validator`) on a simulated clock and network; nothing here opens a socket
(an import-linter contract in pyproject.toml holds that).
"""
