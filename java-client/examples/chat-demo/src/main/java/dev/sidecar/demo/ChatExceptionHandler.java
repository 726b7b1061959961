package dev.sidecar.demo;

import dev.sidecar.client.CacheMissException;
import dev.sidecar.client.DeadlineExceededException;
import dev.sidecar.client.InvalidRequestException;
import dev.sidecar.client.RateLimitedException;
import dev.sidecar.client.SidecarException;
import dev.sidecar.client.SidecarUnavailableException;
import dev.sidecar.client.UnauthenticatedException;
import dev.sidecar.demo.ChatApi.ErrorReply;
import dev.sidecar.demo.SessionRateLimiter.SessionRateLimitedException;
import dev.sidecar.spring.SpringAiErrors;
import java.time.Duration;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;
import org.springframework.ai.retry.NonTransientAiException;
import org.springframework.ai.retry.TransientAiException;
import org.springframework.http.HttpHeaders;
import org.springframework.http.HttpStatus;
import org.springframework.http.MediaType;
import org.springframework.http.ResponseEntity;
import org.springframework.http.converter.HttpMessageNotReadableException;
import org.springframework.web.HttpMediaTypeNotSupportedException;
import org.springframework.web.bind.MissingRequestHeaderException;
import org.springframework.web.bind.annotation.ExceptionHandler;
import org.springframework.web.bind.annotation.RestControllerAdvice;

/**
 * Maps failures to HTTP: rate limit (the sidecar's or this app's per-session one) -> 429
 * with Retry-After, sidecar down/draining -> 503, bad input or unknown model -> 400,
 * deadline -> 504, other sidecar errors -> 502. The chat model's Spring AI exceptions
 * are answered by the typed sidecar exception they wrap.
 */
@RestControllerAdvice
public class ChatExceptionHandler {

    private static final Logger log = LoggerFactory.getLogger(ChatExceptionHandler.class);

    /** Spring AI's Transient/NonTransientAiException from the chat model: answered by their sidecar cause. */
    @ExceptionHandler({TransientAiException.class, NonTransientAiException.class})
    public ResponseEntity<ErrorReply> springAi(RuntimeException e) {
        SidecarException cause = SpringAiErrors.sidecarCause(e);
        if (cause == null) {
            log.warn("model call failed: {}", e.getMessage());
            return ResponseEntity.status(HttpStatus.BAD_GATEWAY).contentType(MediaType.APPLICATION_JSON)
                    .body(new ErrorReply("sidecar_error", e.getMessage(), null));
        }
        return sidecar(cause);
    }

    @ExceptionHandler(SessionRateLimitedException.class)
    public ResponseEntity<ErrorReply> sessionLimit(SessionRateLimitedException e) {
        return tooManyRequests(ResponseEntity.status(HttpStatus.TOO_MANY_REQUESTS), e.getRetryAfter(), e.getMessage());
    }

    private static ResponseEntity<ErrorReply> tooManyRequests(ResponseEntity.BodyBuilder b, Duration after,
                                                              String message) {
        // Retry-After is whole seconds; round up so clients never come back too early.
        b.header(HttpHeaders.RETRY_AFTER, Long.toString(Math.max(1, (after.toMillis() + 999) / 1000)));
        return b.contentType(MediaType.APPLICATION_JSON).body(new ErrorReply("rate_limited", message, after.toMillis()));
    }

    @ExceptionHandler(SidecarException.class)
    public ResponseEntity<ErrorReply> sidecar(SidecarException e) {
        HttpStatus status = status(e);
        ResponseEntity.BodyBuilder b = ResponseEntity.status(status).contentType(MediaType.APPLICATION_JSON);
        Long retryMs = null;
        if (e instanceof RateLimitedException rl) {
            Duration after = rl.getRetryAfter().orElse(Duration.ofSeconds(1));
            retryMs = after.toMillis();
            // Retry-After is whole seconds; round up so clients never come back too early.
            b.header(HttpHeaders.RETRY_AFTER, Long.toString(Math.max(1, (after.toMillis() + 999) / 1000)));
        }
        if (status.is5xxServerError()) {
            log.warn("sidecar call failed: {}", e.getMessage());
        }
        return b.body(new ErrorReply(errorCode(e), e.getMessage(), retryMs));
    }

    @ExceptionHandler({IllegalArgumentException.class, HttpMessageNotReadableException.class,
            MissingRequestHeaderException.class})
    public ResponseEntity<ErrorReply> badRequest(Exception e) {
        String message = e instanceof HttpMessageNotReadableException ? "body: must be JSON {\"message\": \"...\"}"
                : e.getMessage();
        return ResponseEntity.badRequest().contentType(MediaType.APPLICATION_JSON)
                .body(new ErrorReply("invalid_request", message, null));
    }

    @ExceptionHandler(HttpMediaTypeNotSupportedException.class)
    public ResponseEntity<ErrorReply> mediaType(HttpMediaTypeNotSupportedException e) {
        return ResponseEntity.status(HttpStatus.UNSUPPORTED_MEDIA_TYPE).contentType(MediaType.APPLICATION_JSON)
                .body(new ErrorReply("invalid_request", "Content-Type: must be application/json", null));
    }

    static HttpStatus status(SidecarException e) {
        if (e instanceof RateLimitedException) {
            return HttpStatus.TOO_MANY_REQUESTS;
        }
        if (e instanceof SidecarUnavailableException) {
            return HttpStatus.SERVICE_UNAVAILABLE;
        }
        if (e instanceof InvalidRequestException) {
            return HttpStatus.BAD_REQUEST;
        }
        if (e instanceof DeadlineExceededException) {
            return HttpStatus.GATEWAY_TIMEOUT;
        }
        if (e instanceof CacheMissException) {
            return HttpStatus.NOT_FOUND;
        }
        // UnauthenticatedException is the demo's own misconfiguration: not the caller's fault.
        return HttpStatus.BAD_GATEWAY;
    }

    static String errorCode(Throwable error) {
        SidecarException cause = SpringAiErrors.sidecarCause(error);
        Throwable e = cause != null ? cause : error;
        if (e instanceof RateLimitedException || e instanceof SessionRateLimitedException) {
            return "rate_limited";
        }
        if (e instanceof SidecarUnavailableException) {
            return "sidecar_unavailable";
        }
        if (e instanceof InvalidRequestException || e instanceof IllegalArgumentException) {
            return "invalid_request";
        }
        if (e instanceof DeadlineExceededException) {
            return "timeout";
        }
        if (e instanceof UnauthenticatedException) {
            return "sidecar_auth";
        }
        return "sidecar_error";
    }
}
