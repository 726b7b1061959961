package dev.sidecar.client;

import io.grpc.Status;

/** DEADLINE_EXCEEDED: the call's deadline passed; the sidecar aborted the request. */
public class DeadlineExceededException extends SidecarException {

    public DeadlineExceededException(Status.Code code, String message, Throwable cause) {
        super(code, message, cause);
    }
}
