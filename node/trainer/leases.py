"""The lease book moved to `swarmrl.protocol.leases` (pure, clock injected) so the simulator runs it too."""

from swarmrl.protocol.leases import LeaseBook

__all__ = ["LeaseBook"]
