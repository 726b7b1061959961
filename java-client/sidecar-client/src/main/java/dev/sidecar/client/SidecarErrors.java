package dev.sidecar.client;

import io.grpc.Metadata;
import io.grpc.Status;
import io.grpc.StatusException;
import io.grpc.StatusRuntimeException;
import java.time.Duration;
import java.util.concurrent.CancellationException;
import java.util.concurrent.CompletionException;
import java.util.concurrent.ExecutionException;

/** Maps gRPC failures to the typed {@link SidecarException} hierarchy. */
public final class SidecarErrors {

    /** Trailing metadata key carrying the server's suggested retry delay in milliseconds. */
    public static final Metadata.Key<String> RETRY_AFTER_MS =
            Metadata.Key.of("retry-after-ms", Metadata.ASCII_STRING_MARSHALLER);

    private SidecarErrors() {
    }

    /**
     * Converts any throwable from a gRPC call into a {@link SidecarException}; one that
     * already is one is returned unchanged, wrappers from futures are unwrapped.
     */
    public static SidecarException from(Throwable error) {
        Throwable t = error;
        while ((t instanceof CompletionException || t instanceof ExecutionException) && t.getCause() != null) {
            t = t.getCause();
        }
        if (t instanceof SidecarException se) {
            return se;
        }
        Status status;
        Metadata trailers;
        if (t instanceof StatusRuntimeException sre) {
            status = sre.getStatus();
            trailers = sre.getTrailers();
        } else if (t instanceof StatusException se) {
            status = se.getStatus();
            trailers = se.getTrailers();
        } else if (t instanceof CancellationException) {
            status = Status.CANCELLED.withDescription(t.getMessage());
            trailers = null;
        } else {
            status = Status.fromThrowable(t);
            trailers = Status.trailersFromThrowable(t);
        }
        return from(status, trailers, t);
    }

    static SidecarException from(Status status, Metadata trailers, Throwable cause) {
        Status.Code code = status.getCode();
        String message = code + (status.getDescription() == null ? "" : ": " + status.getDescription());
        if (code == Status.Code.RESOURCE_EXHAUSTED && isMessageTooLarge(status)) {
            // A size limit (the server's on the request, or ours on the response), not a rate
            // limit: retrying the same call cannot succeed.
            return new MessageTooLargeException(code, message, cause);
        }
        if (code == Status.Code.NOT_FOUND && !isCacheMiss(status)) {
            return new ModelNotFoundException(code, message, cause);
        }
        return switch (code) {
            case RESOURCE_EXHAUSTED -> new RateLimitedException(code, message, cause, retryAfter(trailers));
            case INVALID_ARGUMENT, OUT_OF_RANGE -> new InvalidRequestException(code, message, cause);
            case UNAUTHENTICATED -> new UnauthenticatedException(code, message, cause);
            case PERMISSION_DENIED -> new PermissionDeniedException(code, message, cause);
            case UNAVAILABLE -> new SidecarUnavailableException(code, message, cause);
            case DEADLINE_EXCEEDED -> new DeadlineExceededException(code, message, cause);
            case NOT_FOUND -> new CacheMissException(code, message, cause);
            default -> new SidecarException(code, message, cause);
        };
    }

    // grpc-java's wording when a message exceeds maxInboundMessageSize ("... exceeds maximum
    // size ..."), and gRPC core's on the server ("Received message larger than max (N vs. M)",
    // "Sent message larger than max ...").
    private static boolean isMessageTooLarge(Status status) {
        String d = status.getDescription();
        return d != null && (d.contains("exceeds maximum size") || d.contains("message larger than max"));
    }

    // The sidecar answers NOT_FOUND for a cache-only request without a cached answer
    // ("semantic cache miss") and for an unknown model name ("model: unknown model ...").
    private static boolean isCacheMiss(Status status) {
        String d = status.getDescription();
        return d != null && d.contains("cache miss");
    }

    /** Parses {@code retry-after-ms}; a missing or malformed value yields null (no hint). */
    static Duration retryAfter(Metadata trailers) {
        if (trailers == null) {
            return null;
        }
        String raw = trailers.get(RETRY_AFTER_MS);
        if (raw == null) {
            return null;
        }
        try {
            double ms = Double.parseDouble(raw.trim());
            if (!(ms >= 0) || Double.isInfinite(ms)) {
                return null;
            }
            return Duration.ofNanos((long) Math.ceil(ms * 1_000_000d));
        } catch (NumberFormatException e) {
            return null;
        }
    }
}
