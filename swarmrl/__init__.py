"""swarmrl: peer-to-peer LoRA GRPO post-training of language models on volunteer GPUs.

The sub-packages sit at the repository root and are mapped here by setuptools' package-dir:
`swarmrl.protocol` (pure core), `swarmrl.node` (the processes), `swarmrl.validator` and
`swarmrl.simulations`. DESIGN.md is the map.
"""
