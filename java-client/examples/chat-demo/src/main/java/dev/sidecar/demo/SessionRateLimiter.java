package dev.sidecar.demo;

import java.time.Duration;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.function.LongSupplier;
import org.springframework.beans.factory.annotation.Autowired;
import org.springframework.stereotype.Component;

/**
 * Per-session token buckets: each session may send {@code chat-demo.rate-limit.requests-per-minute}
 * turns per minute with bursts of {@code burst}. The sidecar's own limit is per API key, and
 * the demo calls it with one key for all its users; this is what keeps one chatty session
 * from using up everyone's share. Buckets are kept for at most {@code max-sessions}
 * sessions (least recently used dropped; a dropped session starts with a full bucket).
 */
@Component
public class SessionRateLimiter {

    /** Thrown when a session is over its limit; the handler answers 429 with Retry-After. */
    public static final class SessionRateLimitedException extends RuntimeException {

        private final Duration retryAfter;

        SessionRateLimitedException(String sessionId, Duration retryAfter) {
            super("session " + sessionId + ": rate limit exceeded; retry in " + retryAfter.toMillis() + " ms");
            this.retryAfter = retryAfter;
        }

        public Duration getRetryAfter() {
            return retryAfter;
        }
    }

    private static final class Bucket {
        double tokens;
        long updatedNanos;
    }

    private final double perNano;
    private final double capacity;
    private final LongSupplier clock;
    private final Map<String, Bucket> buckets;

    @Autowired
    public SessionRateLimiter(ChatDemoProperties props) {
        this(props, System::nanoTime);
    }

    SessionRateLimiter(ChatDemoProperties props, LongSupplier clock) {
        ChatDemoProperties.RateLimit limit = props.rateLimit();
        this.perNano = limit.requestsPerMinute() / 60e9;
        this.capacity = Math.max(1, limit.burst());
        this.clock = clock;
        int maxSessions = props.maxSessions();
        this.buckets = new LinkedHashMap<>(16, 0.75f, true) {
            @Override
            protected boolean removeEldestEntry(Map.Entry<String, Bucket> eldest) {
                return size() > maxSessions;
            }
        };
    }

    /** Takes one request from the session's bucket, or throws when it is empty. A limit of 0 disables it. */
    public synchronized void acquire(String sessionId) {
        if (perNano <= 0) {
            return;
        }
        long now = clock.getAsLong();
        Bucket b = buckets.computeIfAbsent(sessionId, k -> {
            Bucket nb = new Bucket();
            nb.tokens = capacity;
            nb.updatedNanos = now;
            return nb;
        });
        b.tokens = Math.min(capacity, b.tokens + (now - b.updatedNanos) * perNano);
        b.updatedNanos = now;
        if (b.tokens >= 1) {
            b.tokens -= 1;
            return;
        }
        long waitNanos = (long) Math.ceil((1 - b.tokens) / perNano);
        throw new SessionRateLimitedException(sessionId, Duration.ofNanos(waitNanos));
    }
}
