"""hivemind matchmaking whose leader turns away a joiner with a refused ticket, before the group forms.

The all-reduce leaves a refused member out (`node.swarm.averaging`, point 5), but by then it holds
a seat: a round that waits for `expected` members starts as soon as that many joined, so an
outsider that joins first could keep an honest trainer out of the round. A leader built from
`admitting_matchmaking` checks each join request's gathered ticket (`protocol.averaging_ticket`)
against its own round and answers a refused one with hivemind's PROTOCOL_VIOLATION, so the
seat stays free for a member whose ticket holds; the refusal is reported with the leader's next
round (`refused`). A leader that is itself the outsider can still
choose whom it admits; the members it gathers then leave it out at the all-reduce.
"""

from __future__ import annotations

import logging
from typing import Any

from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer

from swarmrl.protocol.averaging_ticket import check_member

log = logging.getLogger(__name__)


def _user_info(data_for_gather: bytes) -> dict[str, Any]:
    """The user metadata inside a member's gathered bytes ([bandwidth, mode, user bytes]), {} if none."""
    _, _, user = MSGPackSerializer.loads(data_for_gather)
    info = MSGPackSerializer.loads(user)
    return info if isinstance(info, dict) else {}


def admitting_matchmaking(job_id: str, kind: str, allowed: frozenset[str] | None) -> type[Matchmaking]:
    """A `Matchmaking` class whose leader admits only joiners whose ticket holds for (`job_id`,
    `kind`, its own round's version) and, with `allowed`, names an allowed trainer."""

    class AdmittingMatchmaking(Matchmaking):  # type: ignore[misc]  # hivemind ships no type hints
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.refused: dict[str, str] = {}   # joiners turned away since the averager last read them: peer -> reason

        def _check_reasons_to_reject(self, request: averaging_pb2.JoinRequest,
                                     context: P2PContext) -> averaging_pb2.MessageFromLeader | None:
            reason: averaging_pb2.MessageFromLeader | None = super()._check_reasons_to_reject(request, context)
            if reason is not None:
                return reason
            try:
                version = int(_user_info(self.step_control.data_for_gather).get("version", -1))
                info = _user_info(request.gather)
            except Exception:  # noqa: BLE001 - a joiner's bytes that don't parse are its protocol violation
                return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            check = check_member(info, context.remote_id.to_bytes(), job_id=job_id, kind=kind, version=version,
                                 allowed=allowed)
            if check.admitted:
                return None
            log.warning("averaging %s: join request of %s refused: %s", kind, context.remote_id, check.reason)
            self.refused[context.remote_id.to_base58()] = check.reason
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)

    return AdmittingMatchmaking
