"""Identities, key files and signed envelopes."""

import stat

import pytest

from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity, peer_id_from_public_key
from swarmrl.protocol.pb import swarm_pb2 as pb


def test_key_file_mode_0600_and_roundtrip(tmp_path):
    ident = Identity.generate()
    path = tmp_path / "keys" / "w.key"
    ident.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load(path).peer_id == ident.peer_id
    with pytest.raises(FileExistsError):
        ident.save(path)


def test_loose_key_file_is_refused(tmp_path):
    path = tmp_path / "w.key"
    Identity.generate().save(path)
    path.chmod(0o644)
    with pytest.raises(ValueError, match="0600"):
        Identity.load(path)


def test_peer_id_is_derived_from_public_key():
    ident = Identity.from_seed(b"\x01" * 32)
    assert ident.peer_id == peer_id_from_public_key(ident.public_key)
    assert len(ident.peer_id) == 40
    assert Identity.from_seed(b"\x02" * 32).peer_id != ident.peer_id


def test_sign_and_open():
    ident = Identity.generate()
    env = signing.sign(ident, signing.LEASE_REQUEST, pb.LeaseRequest(job_id="j", max_prompts=3))
    msg, signer = signing.open_signed(env, signing.LEASE_REQUEST, pb.LeaseRequest)
    assert msg.job_id == "j" and msg.max_prompts == 3 and signer == ident.peer_id


def test_signature_for_one_domain_does_not_verify_in_another():
    env = signing.sign(Identity.generate(), signing.LEASE_REQUEST, pb.LeaseRequest(job_id="j"))
    with pytest.raises(signing.SignatureError) as err:
        signing.open_signed(env, signing.ROLLOUT_BATCH, pb.RolloutBatch)
    assert err.value.reason == "bad_signature"


def test_tampered_body_or_swapped_key_fails():
    a, b = Identity.generate(), Identity.generate()
    env = signing.sign(a, signing.JOB, pb.Job(spec_json="{}"))
    tampered = pb.Signed(body=env.body + b"\x00", public_key=env.public_key, signature=env.signature)
    swapped = pb.Signed(body=env.body, public_key=b.public_key, signature=env.signature)
    short = pb.Signed(body=env.body, public_key=b"x", signature=env.signature)
    for bad in (tampered, swapped, short):
        with pytest.raises(signing.SignatureError):
            signing.open_signed(bad, signing.JOB, pb.Job)


def test_malformed_body_with_valid_signature_is_reported_as_malformed():
    ident = Identity.generate()
    body = b"\xff\xff\xff"
    sig = ident.sign_raw(b"swarmrl.v1/job\x00" + body)
    with pytest.raises(signing.SignatureError) as err:
        signing.open_signed(pb.Signed(body=body, public_key=ident.public_key, signature=sig), signing.JOB, pb.Job)
    assert err.value.reason == "malformed"
