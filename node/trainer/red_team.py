"""Trainers in the red team (issue 27 item 4, docs/CREDIT.md): a trainer that cooks the books it
signs, for drills of `swarmrl audit` (`TrainerConfig.red_team`, `swarmrl up --red-team MODE`).

The drill sits between the step and the statement it signs (`StatementBook`): the step trains
and the ledger records what it really did; only the public statement lies. Each mode is a lie
an audit must name:

- `omit_groups`: a victim worker (the lowest peer id credited in the first statement that
  credits anyone) is never credited again: its trained groups are left out of every statement
  (neither credited nor listed dropped). Its receipts prove the omission (`omitted_group`).
- `sybil_credit`: every statement that credits anyone also credits a batch the trainer never
  received, to a sybil key of its own (one admitted group, tokens as an honest group's). The
  trainer can't serve it (`unknown_batch`).
- `misstated_adapter`: every statement names an adapter hash other than the one its version's
  signed update publishes (the update's `from_hash`: the version before) (`adapter_mismatch`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from swarmrl.protocol.credit import ConsumedGroup
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.red_team_modes import MISSTATED_ADAPTER, OMIT_GROUPS, SYBIL_CREDIT, TRAINER_MODES

SYBIL_PROMPT_BASE = 1 << 40   # the sybil's prompt indices: far above any job's, so no honest index repeats


class StatementDrill:
    """What a cheating trainer writes into its statement of each version instead of the truth.

    mode: one of `TRAINER_MODES`; job_id: the job (seeds the sybil's key and batch ids).

    Raises:
        ValueError: an unknown mode.
    """

    def __init__(self, mode: str, job_id: str) -> None:
        if mode not in TRAINER_MODES:
            raise ValueError(f"unknown trainer red-team mode {mode!r}; known: {', '.join(TRAINER_MODES)}")
        self.mode, self.job_id = mode, job_id
        self.sybil = Identity.from_seed(hashlib.sha256(b"sybil\0" + job_id.encode()).digest())
        self.victim: str | None = None

    def trained(self, version: int, groups: Sequence[ConsumedGroup]) -> list[ConsumedGroup]:
        """The groups the statement of `version` credits, for the trained `groups`."""
        out = list(groups)
        if self.mode == OMIT_GROUPS:
            if self.victim is None and out:
                self.victim = min(g.peer_id for g in out)
            return [g for g in out if g.peer_id != self.victim]
        if self.mode == SYBIL_CREDIT and out:
            batch_id = hashlib.sha256(b"never received\0" + self.job_id.encode() + version.to_bytes(8, "big")).hexdigest()
            tokens = max(1, sum(g.tokens for g in out) // len(out))
            out.append(ConsumedGroup(batch_id=batch_id, peer_id=self.sybil.peer_id,
                                     prompt_index=SYBIL_PROMPT_BASE + version, tokens=tokens))
        return out

    def update(self, update: pb.AdapterUpdate) -> pb.AdapterUpdate:
        """The signed update the statement names for its version (`update`: the real one)."""
        if self.mode != MISSTATED_ADAPTER:
            return update
        lie = pb.AdapterUpdate()
        lie.CopyFrom(update)
        lie.to_hash = update.from_hash or hashlib.sha256(b"misstated\0" + update.to_hash).digest()
        return lie


def drill_for(mode: str | None, job_id: str) -> StatementDrill | None:
    """The statement drill of a trainer's `red_team` mode (None: an honest trainer)."""
    return None if mode is None else StatementDrill(mode, job_id)

