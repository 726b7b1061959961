"""Container health probe: exit 0 when the sidecar's gRPC health service says SERVING.

Used by the images' HEALTHCHECK and the compose healthchecks. The port is the
one ``sidecar serve`` itself would bind: read from the same config file and
SIDECAR_* environment (``load_config``), unless ``--target`` names it. Exit 1
on NOT_SERVING (loading or draining), connection failure or timeout, with one
line on stderr saying which. Only grpcio, grpcio-health-checking and
sidecar.config are imported, so a probe costs well under a second.
"""
from __future__ import annotations

import argparse
import os
import sys

DEFAULT_CONFIG = "/etc/sidecar/sidecar.yaml"


def _target(args: argparse.Namespace) -> str:
    if args.target:
        return args.target
    from sidecar.config import load_config

    path = args.config if args.config and os.path.isfile(args.config) else None
    port = load_config(path).server.grpc_port
    return f"127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help="sidecar YAML config used to find the gRPC port (skipped when missing)")
    parser.add_argument("--target", default=None, help="host:port to probe instead of the configured port")
    parser.add_argument("--service", default="", help="health service name ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds before the probe fails")
    args = parser.parse_args(argv)

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        target = _target(args)
    except ValueError as exc:  # a bad SIDECAR_* value: the server would refuse to start too
        print(f"unhealthy: config: {exc}", file=sys.stderr)
        return 1
    try:
        with grpc.insecure_channel(target) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"unhealthy: {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"unhealthy: {target}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
