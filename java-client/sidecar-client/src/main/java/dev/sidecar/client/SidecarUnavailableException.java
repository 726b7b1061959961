package dev.sidecar.client;

import io.grpc.Status;

/** UNAVAILABLE: the sidecar is loading, draining or unreachable (after the configured retries). */
public class SidecarUnavailableException extends SidecarException {

    public SidecarUnavailableException(Status.Code code, String message, Throwable cause) {
        super(code, message, cause);
    }
}
