package dev.sidecar.client;

import io.grpc.Status;

/** UNAUTHENTICATED: the API key is missing or unknown. */
public class UnauthenticatedException extends SidecarException {

    public UnauthenticatedException(Status.Code code, String message, Throwable cause) {
        super(code, message, cause);
    }
}
