package dev.sidecar.demo;

import org.springframework.boot.context.properties.ConfigurationProperties;
import org.springframework.boot.context.properties.bind.DefaultValue;

/**
 * Settings under {@code chat-demo}.
 *
 * @param systemPrompt  the system message that starts every conversation (a shared prefix)
 * @param maxSessions   sessions kept in memory; the least recently used is dropped beyond it
 * @param maxTurns      user/assistant exchanges kept per session; the oldest are dropped
 * @param maxMessageChars longest accepted user message
 */
@ConfigurationProperties(prefix = "chat-demo")
public record ChatDemoProperties(
        @DefaultValue("You are a helpful assistant. Answer briefly.") String systemPrompt,
        @DefaultValue("10000") int maxSessions,
        @DefaultValue("10") int maxTurns,
        @DefaultValue("8000") int maxMessageChars) {

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
}
