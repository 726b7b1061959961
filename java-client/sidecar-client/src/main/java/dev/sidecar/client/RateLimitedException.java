package dev.sidecar.client;

import io.grpc.Status;
import java.time.Duration;
import java.util.Optional;

/**
 * RESOURCE_EXHAUSTED: the caller's rate limit was hit or the sidecar's waiting queue
 * is full. {@link #getRetryAfter()} is the delay the server suggested in the trailing
 * metadata {@code retry-after-ms}, when it sent one.
 */
public class RateLimitedException extends SidecarException {

    private final Duration retryAfter;

    public RateLimitedException(Status.Code code, String message, Throwable cause, Duration retryAfter) {
        super(code, message, cause);
        this.retryAfter = retryAfter;
    }

    /** The server's suggested retry delay; empty when the trailers carried none. */
    public Optional<Duration> getRetryAfter() {
        return Optional.ofNullable(retryAfter);
    }
}
