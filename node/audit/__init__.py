"""audit/: anyone's audit of a trainer's credit books (`swarmrl audit`, `swarmrl up`'s end-of-run
audit, the validator's audit mode): the gRPC client of the books and one audit's run."""
