package dev.sidecar.spring;

import dev.sidecar.v1.CacheInfo;
import dev.sidecar.v1.ChatMessage;
import dev.sidecar.v1.ChatRequest;
import dev.sidecar.v1.Completion;
import dev.sidecar.v1.CompletionChunk;
import dev.sidecar.v1.FinishReason;
import dev.sidecar.v1.ResponseFormat;
import dev.sidecar.v1.SamplingParams;
import dev.sidecar.v1.Timing;
import dev.sidecar.v1.Tool;
import dev.sidecar.v1.ToolCall;
import dev.sidecar.v1.ToolChoice;
import dev.sidecar.v1.Usage;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import org.springframework.ai.chat.messages.AssistantMessage;
import org.springframework.ai.chat.messages.Message;
import org.springframework.ai.chat.messages.MessageType;
import org.springframework.ai.chat.messages.ToolResponseMessage;
import org.springframework.ai.chat.metadata.ChatGenerationMetadata;
import org.springframework.ai.chat.metadata.ChatResponseMetadata;
import org.springframework.ai.chat.metadata.DefaultUsage;
import org.springframework.ai.chat.model.ChatResponse;
import org.springframework.ai.chat.model.Generation;
import org.springframework.ai.chat.prompt.Prompt;
import org.springframework.ai.content.MediaContent;
import org.springframework.ai.tool.definition.ToolDefinition;

/** Converts Spring AI prompts to wire requests and wire completions to {@link ChatResponse}s. */
final class ChatMapping {

    private ChatMapping() {
    }

    /**
     * The wire request. {@code tools} are the definitions of the options' tool callbacks. Input
     * the sidecar cannot take (media, an empty tool response) fails naming the field; nothing is
     * dropped silently.
     */
    static ChatRequest toRequest(Prompt prompt, SidecarChatOptions options, List<ToolDefinition> tools) {
        List<Message> messages = prompt.getInstructions();
        if (messages.isEmpty()) {
            throw new IllegalArgumentException("prompt.messages: at least one message is required");
        }
        ChatRequest.Builder req = ChatRequest.newBuilder();
        for (int i = 0; i < messages.size(); i++) {
            addMessage(req, messages.get(i), "prompt.messages[" + i + "]");
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
        for (ToolDefinition t : tools) {
            Tool.Builder tool = Tool.newBuilder().setName(t.name());
            if (t.description() != null) {
                tool.setDescription(t.description());
            }
            if (t.inputSchema() != null) {
                tool.setParameters(t.inputSchema());
            }
            req.addTools(tool);
        }
        if (options.getToolChoice() != null) {
            req.setToolChoice(turnToolChoice(options.getToolChoice(), messages));
        }
        if (options.getParallelToolCalls() != null) {
            req.setParallelToolCalls(options.getParallelToolCalls());
        }
        if (options.getReasoningEffort() != null) {
            req.setReasoningEffort(options.getReasoningEffort());
        }
        ResponseFormat format = responseFormat(options);
        if (format != null) {
            req.setResponseFormat(format);
        }
        return req.build();
    }

    /**
     * A forced choice (required, a named function) holds for a turn that asks; on the turn that
     * brings the tools' results back (the last message is a tool message) it becomes auto, so a
     * tool loop ends with an answer instead of calling again until a limit stops it.
     */
    static ToolChoice turnToolChoice(ToolChoice choice, List<Message> messages) {
        boolean forced = choice.getMode() == ToolChoice.Mode.MODE_REQUIRED
                || choice.getMode() == ToolChoice.Mode.MODE_FUNCTION;
        boolean answersTools = messages.get(messages.size() - 1).getMessageType() == MessageType.TOOL;
        return forced && answersTools ? ToolChoice.newBuilder().setMode(ToolChoice.Mode.MODE_AUTO).build() : choice;
    }

    private static void addMessage(ChatRequest.Builder req, Message m, String field) {
        if (m instanceof MediaContent mc && mc.getMedia() != null && !mc.getMedia().isEmpty()) {
            throw new IllegalArgumentException(field + ".media: the sidecar takes text only; "
                    + mc.getMedia().size() + " media item(s) (" + mc.getMedia().get(0).getMimeType()
                    + ") cannot be sent");
        }
        String text = m.getText() == null ? "" : m.getText();
        switch (m.getMessageType()) {
            case SYSTEM -> req.addMessages(ChatMessage.newBuilder().setRole("system").setContent(text));
            case USER -> req.addMessages(ChatMessage.newBuilder().setRole("user").setContent(text));
            case ASSISTANT -> {
                ChatMessage.Builder msg = ChatMessage.newBuilder().setRole("assistant").setContent(text);
                if (m instanceof AssistantMessage a) {
                    List<AssistantMessage.ToolCall> calls = a.getToolCalls();
                    for (int j = 0; j < calls.size(); j++) {
                        msg.addToolCalls(toWire(calls.get(j), j, field + ".toolCalls[" + j + "]"));
                    }
                }
                req.addMessages(msg);
            }
            case TOOL -> {
                if (!(m instanceof ToolResponseMessage t) || t.getResponses().isEmpty()) {
                    throw new IllegalArgumentException(field + ".responses: a tool message needs at least one "
                            + "tool response");
                }
                // One wire message per response: each answers one call id.
                for (int j = 0; j < t.getResponses().size(); j++) {
                    ToolResponseMessage.ToolResponse r = t.getResponses().get(j);
                    if (r.id() == null || r.id().isEmpty()) {
                        throw new IllegalArgumentException(field + ".responses[" + j + "].id: required");
                    }
                    ChatMessage.Builder msg = ChatMessage.newBuilder().setRole("tool").setToolCallId(r.id())
                            .setContent(r.responseData() == null ? "" : r.responseData());
                    if (r.name() != null) {
                        msg.setName(r.name());
                    }
                    req.addMessages(msg);
                }
            }
        }
    }

    private static ToolCall toWire(AssistantMessage.ToolCall c, int index, String field) {
        if (c.name() == null || c.name().isEmpty()) {
            throw new IllegalArgumentException(field + ".name: required");
        }
        ToolCall.Builder w = ToolCall.newBuilder().setName(c.name()).setIndex(index)
                .setType(c.type() == null || c.type().isEmpty() ? "function" : c.type())
                .setArguments(c.arguments() == null ? "{}" : c.arguments());
        if (c.id() != null) {
            w.setId(c.id());
        }
        return w.build();
    }

    static AssistantMessage.ToolCall fromWire(ToolCall c) {
        return new AssistantMessage.ToolCall(c.getId(), c.getType().isEmpty() ? "function" : c.getType(),
                c.getName(), c.getArguments());
    }

    /** The explicit response format, else native structured output's schema; both set is a conflict. */
    private static ResponseFormat responseFormat(SidecarChatOptions o) {
        if (o.getOutputSchema() == null) {
            return o.getResponseFormat();
        }
        if (o.getResponseFormat() != null) {
            throw new IllegalArgumentException("options.responseFormat: conflicts with options.outputSchema "
                    + "(native structured output); set one of them");
        }
        return ResponseFormat.newBuilder().setType(ResponseFormat.Type.TYPE_JSON_SCHEMA)
                .setJsonSchema(o.getOutputSchema()).build();
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
        if (o.getBeamWidth() != null) {
            s.setBeamWidth(o.getBeamWidth());
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
        if (o.getLogitBias() != null) {
            for (Map.Entry<String, Integer> e : o.getLogitBias().entrySet()) {
                s.putLogitBias(tokenId(e.getKey()), e.getValue().floatValue());
            }
        }
        return s.build();
    }

    /** A logit_bias key: a token id in decimal text. */
    private static int tokenId(String key) {
        try {
            int id = Integer.parseInt(key);
            if (id >= 0) {
                return id;
            }
        } catch (NumberFormatException e) {
            // named below
        }
        throw new IllegalArgumentException(
                "options.logitBias: keys must be token ids (decimal text), got '" + key + "'");
    }

    static ChatResponse toResponse(Completion c) {
        return response(c.getText(), c.getReasoning(), c.getToolCallsList(), c.getRequestId(), c.getModel(),
                c.getFinishReason(), c.hasUsage() ? c.getUsage() : null, c.hasTiming() ? c.getTiming() : null,
                c.hasCache() ? c.getCache() : null);
    }

    /** One streamed chunk; usage and finish reason are present on the last chunk only. */
    static ChatResponse toResponse(CompletionChunk c, String model) {
        return response(c.getDelta(), c.getReasoningDelta(), c.getToolCallsList(), c.getRequestId(), model,
                c.getFinishReason(), c.hasUsage() ? c.getUsage() : null, c.hasTiming() ? c.getTiming() : null,
                c.hasCache() ? c.getCache() : null);
    }

    private static ChatResponse response(String text, String reasoning, List<ToolCall> calls, String id,
                                         String model, FinishReason finish, Usage usage, Timing timing,
                                         CacheInfo cache) {
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
            if (usage.getReasoningTokens() > 0) {
                extra.put(SidecarChatModel.REASONING_TOKENS, usage.getReasoningTokens());
            }
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
            // Prompt tokens served from the replica's prefix cache are Spring AI's cache-read input tokens
            // (what its OpenAI and Anthropic models report there); nothing is written to a cache on request.
            meta.usage(new DefaultUsage(usage.getPromptTokens(), usage.getCompletionTokens(),
                    usage.getTotalTokens() > 0 ? usage.getTotalTokens()
                            : usage.getPromptTokens() + usage.getCompletionTokens(), usage,
                    (long) usage.getCachedTokens(), null));
        }
        // A thinking model's reasoning goes where Spring AI's own chat models put it: the assistant
        // message's metadata, so the answer (the text) and the reasoning stay apart.
        Map<String, Object> props = reasoning.isEmpty() ? Map.of()
                : Map.of(SidecarChatModel.REASONING_CONTENT, reasoning);
        AssistantMessage output = AssistantMessage.builder().content(text).properties(props)
                .toolCalls(calls.stream().map(ChatMapping::fromWire).toList()).build();
        return new ChatResponse(List.of(new Generation(output, gen.build())), meta.build());
    }

    /** "STOP", "LENGTH", "ABORT", "TOOL_CALLS"; null while a stream is still running. */
    static String finishReason(FinishReason f) {
        return switch (f) {
            case FINISH_REASON_STOP -> "STOP";
            case FINISH_REASON_LENGTH -> "LENGTH";
            case FINISH_REASON_ABORT -> "ABORT";
            case FINISH_REASON_TOOL_CALLS -> "TOOL_CALLS";
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
