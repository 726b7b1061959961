package dev.sidecar.client;

import io.grpc.Status;

/** NOT_FOUND: the semantic cache had no answer for a cache-only request (or the model name is unknown). */
public class CacheMissException extends SidecarException {

    public CacheMissException(Status.Code code, String message, Throwable cause) {
        super(code, message, cause);
    }
}
