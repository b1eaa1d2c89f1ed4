"""The gRPC services every swarmrl server carries besides its own: standard health checking
(grpc.health.v1, so `grpc_health_probe` works) and server reflection (so `grpcurl` can list and
call the services without the .proto files)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # type: ignore[import-untyped]  # no stubs installed
from grpc_reflection.v1alpha import reflection  # type: ignore[import-untyped]  # no stubs installed

from swarmrl.protocol.pb import swarm_pb2 as pb


def add_standard_services(server: grpc.Server, services: list[str]) -> health.HealthServicer:
    """Register health (each of `services` and the whole server "" as SERVING) and reflection
    (`services`, health and reflection itself). Returns the health servicer, so a server can
    report NOT_SERVING while it drains."""
    healthy = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(healthy, server)
    for name in ["", *services]:
        healthy.set(name, health_pb2.HealthCheckResponse.SERVING)
    names = [*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    assert all(s in {d.full_name for d in pb.DESCRIPTOR.services_by_name.values()} for s in services), services
    reflection.enable_server_reflection(names, server)
    return healthy
