package dev.sidecar.client;

import io.grpc.Status;

/**
 * Base of every error the sidecar client raises. Carries the gRPC status code the
 * server (or the local channel) reported, so callers can branch without parsing text.
 */
public class SidecarException extends RuntimeException {

    private final Status.Code code;

    public SidecarException(Status.Code code, String message, Throwable cause) {
        super(message, cause);
        this.code = code;
    }

    /** The gRPC status code behind this error. */
    public Status.Code getCode() {
        return code;
    }
}
