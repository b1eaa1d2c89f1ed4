"""The trainer's gRPC server carries the standard health service and server reflection: the
Python health stub reports SERVING, and a reflection client lists and resolves our service
(what grpc_health_probe and grpcurl use). The validator runs no gRPC server (it is a client)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from swarmrl.node.trainer.service import serve


def test_health_and_reflection_on_the_trainer_server() -> None:
    server, port = serve(trainer=object(), host="127.0.0.1", port=0, max_message_mb=4)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "swarmrl.v1.Trainer"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        try:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
            raise AssertionError("an unknown service should be NOT_FOUND")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"swarmrl.v1.Trainer", "grpc.health.v1.Health"} <= services
        fd = db.FindFileContainingSymbol("swarmrl.v1.Trainer")
        assert fd.package == "swarmrl.v1" and any(s.name == "Trainer" for s in fd.service)
    finally:
        channel.close()
        server.stop(None)
