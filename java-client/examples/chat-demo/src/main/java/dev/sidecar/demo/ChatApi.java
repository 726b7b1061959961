package dev.sidecar.demo;

/** JSON bodies of the chat API. */
public final class ChatApi {

    private ChatApi() {
    }

    /** Request body of both chat endpoints. */
    public record MessageRequest(String message) {
    }

    public record UsageView(int promptTokens, int completionTokens, int cachedTokens, int totalTokens) {
    }

    /**
     * Reply of {@code POST /api/chat/message}. {@code cached} is true when the sidecar's
     * semantic cache answered; {@code usage.cachedTokens} counts prompt tokens whose KV
     * came from the prefix cache (earlier turns of the same session).
     */
    public record MessageReply(String reply, String sessionId, boolean cached, String cacheStatus,
                               Double similarity, String finishReason, UsageView usage, int turns) {
    }

    public record ErrorReply(String error, String message, Long retryAfterMs) {
    }
}
