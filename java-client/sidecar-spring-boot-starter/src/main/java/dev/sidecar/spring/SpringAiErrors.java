package dev.sidecar.spring;

import dev.sidecar.client.DeadlineExceededException;
import dev.sidecar.client.RateLimitedException;
import dev.sidecar.client.SidecarErrors;
import dev.sidecar.client.SidecarException;
import dev.sidecar.client.SidecarUnavailableException;
import io.grpc.StatusException;
import io.grpc.StatusRuntimeException;
import org.springframework.ai.retry.NonTransientAiException;
import org.springframework.ai.retry.TransientAiException;

/**
 * Translates the client's {@link SidecarException}s into Spring AI's retry vocabulary, so
 * Spring AI's retry template and advisors treat sidecar failures like any model's:
 * unavailable / draining, rate-limited or full queue, and deadline exceeded are
 * {@link TransientAiException}s; everything else (bad input, unknown model, auth,
 * cache-only miss, message too large) is a {@link NonTransientAiException}. The typed
 * SidecarException stays the cause (e.g. for {@link RateLimitedException#getRetryAfter()}).
 */
public final class SpringAiErrors {

    private SpringAiErrors() {
    }

    /** The Spring AI exception for {@code error}; errors that are not from a gRPC call are returned as they are. */
    public static RuntimeException translate(Throwable error) {
        if (error instanceof TransientAiException || error instanceof NonTransientAiException) {
            return (RuntimeException) error;
        }
        if (!(error instanceof SidecarException || error instanceof StatusRuntimeException
                || error instanceof StatusException)) {
            return error instanceof RuntimeException re ? re : new IllegalStateException(error.getMessage(), error);
        }
        SidecarException e = SidecarErrors.from(error);
        String message = "sidecar: " + e.getMessage();
        if (isTransient(e)) {
            return new TransientAiException(message, e);
        }
        return new NonTransientAiException(message, e);
    }

    static boolean isTransient(SidecarException e) {
        return e instanceof SidecarUnavailableException || e instanceof RateLimitedException
                || e instanceof DeadlineExceededException;
    }

    /** The SidecarException behind a Spring AI exception (or the error itself); null when there is none. */
    public static SidecarException sidecarCause(Throwable error) {
        for (Throwable t = error; t != null; t = t.getCause()) {
            if (t instanceof SidecarException se) {
                return se;
            }
            if (t.getCause() == t) {
                break;
            }
        }
        return null;
    }
}
