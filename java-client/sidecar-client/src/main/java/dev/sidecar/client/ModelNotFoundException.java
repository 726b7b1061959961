package dev.sidecar.client;

import io.grpc.Status;

/**
 * NOT_FOUND for the request's {@code model}: the sidecar serves another model name. The
 * caller's input is wrong, so this is an {@link InvalidRequestException}; retrying cannot help.
 */
public class ModelNotFoundException extends InvalidRequestException {

    public ModelNotFoundException(Status.Code code, String message, Throwable cause) {
        super(code, message, cause);
    }
}
