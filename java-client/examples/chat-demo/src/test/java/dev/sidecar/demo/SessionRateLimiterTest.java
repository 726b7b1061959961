package dev.sidecar.demo;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import dev.sidecar.demo.SessionRateLimiter.SessionRateLimitedException;
import java.time.Duration;
import java.util.concurrent.atomic.AtomicLong;
import org.junit.jupiter.api.Test;

class SessionRateLimiterTest {

    private final AtomicLong now = new AtomicLong();

    private SessionRateLimiter limiter(double perMinute, int burst, int maxSessions) {
        return new SessionRateLimiter(new ChatDemoProperties("s", maxSessions, 1, 10,
                new ChatDemoProperties.RateLimit(perMinute, burst)), now::get);
    }

    @Test
    void burstThenRefillAtTheSustainedRate() {
        SessionRateLimiter l = limiter(60, 2, 10);  // one per second
        l.acquire("a");
        l.acquire("a");
        assertThatThrownBy(() -> l.acquire("a")).isInstanceOfSatisfying(SessionRateLimitedException.class,
                e -> assertThat(e.getRetryAfter()).isEqualTo(Duration.ofSeconds(1)));
        now.addAndGet(Duration.ofMillis(500).toNanos());
        assertThatThrownBy(() -> l.acquire("a")).isInstanceOfSatisfying(SessionRateLimitedException.class,
                e -> assertThat(e.getRetryAfter()).isEqualTo(Duration.ofMillis(500)));
        now.addAndGet(Duration.ofMillis(500).toNanos());
        l.acquire("a");
    }

    @Test
    void sessionsAreIndependentAndZeroDisablesTheLimit() {
        SessionRateLimiter l = limiter(60, 1, 10);
        l.acquire("a");
        l.acquire("b");
        assertThatThrownBy(() -> l.acquire("a")).isInstanceOf(SessionRateLimitedException.class);

        SessionRateLimiter off = limiter(0, 1, 10);
        for (int i = 0; i < 100; i++) {
            off.acquire("a");
        }
    }

    @Test
    void invalidSettingsNameTheProperty() {
        assertThatThrownBy(() -> new ChatDemoProperties.RateLimit(-1, 1))
                .hasMessageContaining("chat-demo.rate-limit.requests-per-minute");
        assertThatThrownBy(() -> new ChatDemoProperties.RateLimit(1, 0))
                .hasMessageContaining("chat-demo.rate-limit.burst");
    }
}
