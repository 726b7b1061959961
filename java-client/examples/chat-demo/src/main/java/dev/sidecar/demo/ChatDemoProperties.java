package dev.sidecar.demo;

import org.springframework.boot.context.properties.ConfigurationProperties;
import org.springframework.boot.context.properties.bind.DefaultValue;

/**
 * Settings under {@code chat-demo}.
 *
 * @param systemPrompt    the system message that starts every conversation (a shared prefix)
 * @param maxSessions     sessions kept in memory; the least recently used is dropped beyond it
 * @param maxTurns        user/assistant exchanges kept per session; the oldest are dropped
 * @param maxMessageChars longest accepted user message
 * @param rateLimit       per-session request limit (the sidecar's own limit is per API key)
 */
@ConfigurationProperties(prefix = "chat-demo")
public record ChatDemoProperties(
        @DefaultValue("You are a helpful assistant. Answer briefly.") String systemPrompt,
        @DefaultValue("10000") int maxSessions,
        @DefaultValue("10") int maxTurns,
        @DefaultValue("8000") int maxMessageChars,
        @DefaultValue RateLimit rateLimit) {

    public ChatDemoProperties {
        if (maxSessions < 1) {
            throw new IllegalArgumentException("chat-demo.max-sessions: must be >= 1, got " + maxSessions);
        }
        if (maxTurns < 0) {
            throw new IllegalArgumentException("chat-demo.max-turns: must be >= 0, got " + maxTurns);
        }
        if (maxMessageChars < 1) {
            throw new IllegalArgumentException("chat-demo.max-message-chars: must be >= 1, got " + maxMessageChars);
        }
    }

    /**
     * Per-session limit under {@code chat-demo.rate-limit}.
     *
     * @param requestsPerMinute turns a session may send per minute, sustained; 0 disables the limit
     * @param burst             turns a session may send at once after being idle
     */
    public record RateLimit(@DefaultValue("20") double requestsPerMinute, @DefaultValue("5") int burst) {

        public RateLimit {
            if (requestsPerMinute < 0) {
                throw new IllegalArgumentException(
                        "chat-demo.rate-limit.requests-per-minute: must be >= 0, got " + requestsPerMinute);
            }
            if (burst < 1) {
                throw new IllegalArgumentException("chat-demo.rate-limit.burst: must be >= 1, got " + burst);
            }
        }
    }
}
