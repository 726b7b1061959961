package dev.sidecar.client;

import io.grpc.Status;

/**
 * RESOURCE_EXHAUSTED because a message exceeded a size limit: the request was larger than
 * the sidecar's {@code --max-message-bytes}, or the response larger than this client's
 * {@code maxInboundMessageSize}. Not a rate limit: retrying the same call cannot succeed.
 */
public class MessageTooLargeException extends SidecarException {

    public MessageTooLargeException(Status.Code code, String message, Throwable cause) {
        super(code, message, cause);
    }
}
