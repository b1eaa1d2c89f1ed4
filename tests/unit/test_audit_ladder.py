"""`swarmrl audit --recheck` on a machine that can't judge the job: one clear error (exit 2 by the
CLI's rule for UsageError), nothing loaded, the temporary validator stores removed."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmrl.node.cli.audit_ladder import ladder
from swarmrl.node.cli.checks import UsageError
from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb


def test_a_base_model_not_in_the_cache_is_a_usage_error(tmp_path: Path) -> None:
    trainer = Identity.generate()
    record = pb.JobRecord(job_id="j1", trainer_id=trainer.peer_id, endpoint="127.0.0.1:1",
                          base_model="nobody/unknown-model", base_model_sha256=bytes(32), spec_json="{}")
    rec = VerifiedRecord(record, trainer.peer_id, trainer.public_key)
    with pytest.raises(UsageError, match="can't judge job 'j1': its base model nobody/unknown-model"), \
            ladder(rec, Identity.generate(), tmp_path):
        pass
    assert list(tmp_path.iterdir()) == []   # nothing was downloaded or written to the cache
