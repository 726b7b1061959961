package dev.sidecar.client;

import io.grpc.Status;

/** INVALID_ARGUMENT: a request field is invalid; the message names the field. */
public class InvalidRequestException extends SidecarException {

    public InvalidRequestException(Status.Code code, String message, Throwable cause) {
        super(code, message, cause);
    }
}
