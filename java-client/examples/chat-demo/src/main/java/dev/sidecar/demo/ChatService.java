package dev.sidecar.demo;

import dev.sidecar.demo.ChatApi.MessageReply;
import dev.sidecar.demo.ChatApi.UsageView;
import dev.sidecar.spring.SidecarChatModel;
import dev.sidecar.spring.SidecarChatOptions;
import java.util.List;
import java.util.regex.Pattern;
import org.springframework.ai.chat.client.ChatClient;
import org.springframework.ai.chat.messages.Message;
import org.springframework.ai.chat.metadata.ChatResponseMetadata;
import org.springframework.ai.chat.metadata.Usage;
import org.springframework.ai.chat.model.ChatResponse;
import org.springframework.stereotype.Service;
import reactor.core.publisher.Flux;

/**
 * Runs one chat turn for a session: [system prompt, earlier exchanges, new user message]
 * through {@link ChatClient}, then records the exchange. The history is only recorded
 * after a successful answer, so a failed turn (rate limit, sidecar down) can be retried
 * without duplicating the user's message.
 */
@Service
public class ChatService {

    private static final Pattern SESSION_ID = Pattern.compile("[A-Za-z0-9._:-]{1,128}");

    private final ChatClient chatClient;
    private final ConversationStore store;
    private final ChatDemoProperties props;
    private final SessionRateLimiter limiter;

    public ChatService(ChatClient.Builder builder, ConversationStore store, ChatDemoProperties props,
                       SessionRateLimiter limiter) {
        this.chatClient = builder.defaultSystem(props.systemPrompt()).build();
        this.store = store;
        this.props = props;
        this.limiter = limiter;
    }

    /** The caller's session id, or a new one when absent; rejects ids that are not plain tokens. */
    public String sessionId(String header) {
        if (header == null || header.isBlank()) {
            return java.util.UUID.randomUUID().toString();
        }
        if (!SESSION_ID.matcher(header).matches()) {
            throw new IllegalArgumentException("X-Session-ID: must be 1-128 characters of [A-Za-z0-9._:-]");
        }
        return header;
    }

    public String validMessage(ChatApi.MessageRequest body) {
        String message = body == null ? null : body.message();
        if (message == null || message.isBlank()) {
            throw new IllegalArgumentException("message: must not be blank");
        }
        if (message.length() > props.maxMessageChars()) {
            throw new IllegalArgumentException("message: at most " + props.maxMessageChars()
                    + " characters, got " + message.length());
        }
        return message;
    }

    public MessageReply send(String sessionId, String message) {
        limiter.acquire(sessionId);
        List<Message> history = store.history(sessionId);
        ChatResponse response = chatClient.prompt().messages(history).user(message).options(affinity(sessionId)).call().chatResponse();
        String reply = response == null || response.getResult() == null ? ""
                : String.valueOf(response.getResult().getOutput().getText());
        store.append(sessionId, message, reply);
        return toReply(sessionId, reply, response);
    }

    /** Streams the answer; the exchange is recorded when the stream completes normally. */
    public Flux<ChatResponse> stream(String sessionId, String message) {
        limiter.acquire(sessionId);
        List<Message> history = store.history(sessionId);
        StringBuilder answer = new StringBuilder();
        return chatClient.prompt().messages(history).user(message).options(affinity(sessionId)).stream()
                .chatResponse()
                .doOnNext(r -> {
                    if (r.getResult() != null && r.getResult().getOutput().getText() != null) {
                        answer.append(r.getResult().getOutput().getText());
                    }
                })
                .doOnComplete(() -> store.append(sessionId, message, answer.toString()));
    }

    // With sidecar.client.load-balancing-policy=sidecar_session_affinity every turn of a conversation reaches
    // the replica whose prefix cache holds the earlier turns.
    private static SidecarChatOptions.Builder affinity(String sessionId) {
        return SidecarChatOptions.builder().sessionId(sessionId);
    }

    public int turns(String sessionId) {
        return store.turns(sessionId);
    }

    public boolean clear(String sessionId) {
        return store.clear(sessionId);
    }

    MessageReply toReply(String sessionId, String reply, ChatResponse response) {
        ChatResponseMetadata meta = response == null ? null : response.getMetadata();
        String cacheStatus = meta == null ? null : meta.get(SidecarChatModel.CACHE_STATUS);
        Double similarity = meta == null ? null : meta.get(SidecarChatModel.CACHE_SIMILARITY);
        String finish = response == null || response.getResult() == null ? null
                : response.getResult().getMetadata().getFinishReason();
        return new MessageReply(reply, sessionId, cacheStatus != null && cacheStatus.startsWith("HIT"),
                cacheStatus, similarity, finish, usage(meta), store.turns(sessionId));
    }

    static UsageView usage(ChatResponseMetadata meta) {
        if (meta == null || meta.getUsage() == null) {
            return new UsageView(0, 0, 0, 0);
        }
        Usage u = meta.getUsage();
        Integer cached = meta.get(SidecarChatModel.CACHED_TOKENS);
        return new UsageView(nz(u.getPromptTokens()), nz(u.getCompletionTokens()), nz(cached),
                nz(u.getTotalTokens()));
    }

    private static int nz(Integer v) {
        return v == null ? 0 : v;
    }
}
