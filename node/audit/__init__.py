"""audit/: anyone's audit of a trainer's credit books (`swarmrl audit`, `swarmrl up`'s end-of-run
audit, the validator's audit mode): the books over gRPC, the books from the public record (the
statements peer to peer) and one audit's run."""
