package dev.sidecar.client;

import io.grpc.Status;

/**
 * PERMISSION_DENIED: the key is valid but may not do this, e.g. an operator action such as
 * loading a LoRA adapter called with a tenant key. A subclass of {@link UnauthenticatedException},
 * so code that treats both as "fix the key" keeps working.
 */
public class PermissionDeniedException extends UnauthenticatedException {

    public PermissionDeniedException(Status.Code code, String message, Throwable cause) {
        super(code, message, cause);
    }
}
