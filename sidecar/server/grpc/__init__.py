"""gRPC transport: sidecar.v1.Inference, health and reflection over the service layer."""
