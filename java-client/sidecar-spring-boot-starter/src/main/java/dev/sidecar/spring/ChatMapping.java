package dev.sidecar.spring;

import dev.sidecar.v1.CacheInfo;
import dev.sidecar.v1.ChatMessage;
import dev.sidecar.v1.ChatRequest;
import dev.sidecar.v1.Completion;
import dev.sidecar.v1.CompletionChunk;
import dev.sidecar.v1.FinishReason;
import dev.sidecar.v1.SamplingParams;
import dev.sidecar.v1.Timing;
import dev.sidecar.v1.Usage;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import org.springframework.ai.chat.messages.AssistantMessage;
import org.springframework.ai.chat.messages.Message;
import org.springframework.ai.chat.metadata.ChatGenerationMetadata;
import org.springframework.ai.chat.metadata.ChatResponseMetadata;
import org.springframework.ai.chat.metadata.DefaultUsage;
import org.springframework.ai.chat.model.ChatResponse;
import org.springframework.ai.chat.model.Generation;
import org.springframework.ai.chat.prompt.Prompt;

/** Converts Spring AI prompts to wire requests and wire completions to {@link ChatResponse}s. */
final class ChatMapping {

    private ChatMapping() {
    }

    static ChatRequest toRequest(Prompt prompt, SidecarChatOptions options) {
        List<Message> messages = prompt.getInstructions();
        if (messages.isEmpty()) {
            throw new IllegalArgumentException("prompt.messages: at least one message is required");
        }
        ChatRequest.Builder req = ChatRequest.newBuilder();
        for (int i = 0; i < messages.size(); i++) {
            Message m = messages.get(i);
            String role = switch (m.getMessageType()) {
                case SYSTEM -> "system";
                case USER -> "user";
                case ASSISTANT -> "assistant";
                case TOOL -> throw new IllegalArgumentException(
                        "prompt.messages[" + i + "]: tool messages are not supported by the sidecar");
            };
            req.addMessages(ChatMessage.newBuilder().setRole(role).setContent(m.getText() == null ? "" : m.getText()));
        }
        req.setSampling(sampling(options));
        if (options.getModel() != null) {
            req.setModel(options.getModel());
        }
        if (options.getCacheControl() != null) {
            req.setCacheControl(options.getCacheControl());
        }
        if (options.getCacheSalt() != null) {
            req.setCacheSalt(options.getCacheSalt());
        }
        if (options.getPriority() != null) {
            req.setPriority(options.getPriority());
        }
        return req.build();
    }

    // Only set fields are sent, so the sidecar's defaults apply to the rest; range checks
    // are the server's (its INVALID_ARGUMENT names the field).
    private static SamplingParams sampling(SidecarChatOptions o) {
        SamplingParams.Builder s = SamplingParams.newBuilder();
        if (o.getMaxTokens() != null) {
            s.setMaxTokens(o.getMaxTokens());
        }
        if (o.getTemperature() != null) {
            s.setTemperature(o.getTemperature().floatValue());
        }
        if (o.getTopP() != null) {
            s.setTopP(o.getTopP().floatValue());
        }
        if (o.getTopK() != null) {
            s.setTopK(o.getTopK());
        }
        if (o.getMinP() != null) {
            s.setMinP(o.getMinP().floatValue());
        }
        if (o.getRepetitionPenalty() != null) {
            s.setRepetitionPenalty(o.getRepetitionPenalty().floatValue());
        }
        if (o.getPresencePenalty() != null) {
            s.setPresencePenalty(o.getPresencePenalty().floatValue());
        }
        if (o.getFrequencyPenalty() != null) {
            s.setFrequencyPenalty(o.getFrequencyPenalty().floatValue());
        }
        if (o.getSeed() != null) {
            s.setSeed(o.getSeed());
        }
        if (o.getStopSequences() != null) {
            s.addAllStop(o.getStopSequences());
        }
        return s.build();
    }

    static ChatResponse toResponse(Completion c) {
        return response(c.getText(), c.getRequestId(), c.getModel(), c.getFinishReason(),
                c.hasUsage() ? c.getUsage() : null, c.hasTiming() ? c.getTiming() : null,
                c.hasCache() ? c.getCache() : null);
    }

    /** One streamed chunk; usage and finish reason are present on the last chunk only. */
    static ChatResponse toResponse(CompletionChunk c, String model) {
        return response(c.getDelta(), c.getRequestId(), model, c.getFinishReason(),
                c.hasUsage() ? c.getUsage() : null, c.hasTiming() ? c.getTiming() : null,
                c.hasCache() ? c.getCache() : null);
    }

    /** The whole streamed answer: all deltas' text with the last chunk's usage, finish reason and metadata. */
    static ChatResponse aggregate(String text, CompletionChunk last, String model) {
        return response(text, last.getRequestId(), model, last.getFinishReason(),
                last.hasUsage() ? last.getUsage() : null, last.hasTiming() ? last.getTiming() : null,
                last.hasCache() ? last.getCache() : null);
    }

    private static ChatResponse response(String text, String id, String model, FinishReason finish, Usage usage,
                                         Timing timing, CacheInfo cache) {
        Map<String, Object> extra = new HashMap<>();
        if (cache != null) {
            extra.put(SidecarChatModel.CACHE_STATUS, cacheStatus(cache));
            extra.put(SidecarChatModel.CACHE_SIMILARITY, (double) cache.getSimilarity());
            if (!cache.getMatchedQuery().isEmpty()) {
                extra.put(SidecarChatModel.CACHE_MATCHED_QUERY, cache.getMatchedQuery());
            }
            if (!cache.getBypassReason().isEmpty()) {
                extra.put(SidecarChatModel.CACHE_BYPASS_REASON, cache.getBypassReason());
            }
        }
        if (usage != null) {
            extra.put(SidecarChatModel.CACHED_TOKENS, usage.getCachedTokens());
        }
        if (timing != null) {
            extra.put(SidecarChatModel.TTFT_MS, timing.getTtftMs());
            extra.put(SidecarChatModel.TOTAL_MS, timing.getTotalMs());
            extra.put(SidecarChatModel.QUEUE_MS, timing.getQueueMs());
        }
        ChatGenerationMetadata.Builder gen = ChatGenerationMetadata.builder().metadata(extra);
        String reason = finishReason(finish);
        if (reason != null) {
            gen.finishReason(reason);
        }
        ChatResponseMetadata.Builder meta = ChatResponseMetadata.builder().id(id).metadata(extra);
        if (model != null && !model.isEmpty()) {
            meta.model(model);
        }
        if (usage != null) {
            meta.usage(new DefaultUsage(usage.getPromptTokens(), usage.getCompletionTokens(),
                    usage.getTotalTokens() > 0 ? usage.getTotalTokens()
                            : usage.getPromptTokens() + usage.getCompletionTokens(), usage));
        }
        return new ChatResponse(List.of(new Generation(new AssistantMessage(text), gen.build())), meta.build());
    }

    /** "STOP", "LENGTH", "ABORT"; null while a stream is still running. */
    static String finishReason(FinishReason f) {
        return switch (f) {
            case FINISH_REASON_STOP -> "STOP";
            case FINISH_REASON_LENGTH -> "LENGTH";
            case FINISH_REASON_ABORT -> "ABORT";
            default -> null;
        };
    }

    /** "MISS", "HIT_EXACT", "HIT_SEMANTIC", "BYPASS" or "UNSPECIFIED". */
    static String cacheStatus(CacheInfo c) {
        return switch (c.getStatus()) {
            case CACHE_STATUS_MISS -> "MISS";
            case CACHE_STATUS_HIT_EXACT -> "HIT_EXACT";
            case CACHE_STATUS_HIT_SEMANTIC -> "HIT_SEMANTIC";
            case CACHE_STATUS_BYPASS -> "BYPASS";
            default -> "UNSPECIFIED";
        };
    }
}
