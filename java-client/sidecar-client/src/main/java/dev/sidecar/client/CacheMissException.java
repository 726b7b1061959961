package dev.sidecar.client;

import io.grpc.Status;

/** NOT_FOUND for a cache-only request: the semantic cache had no answer (an unknown model is a {@link ModelNotFoundException}). */
public class CacheMissException extends SidecarException {

    public CacheMissException(Status.Code code, String message, Throwable cause) {
        super(code, message, cause);
    }
}
