package dev.sidecar.spring;

import dev.sidecar.client.SessionAffinity;
import dev.sidecar.client.SidecarClient;
import dev.sidecar.v1.ChatRequest;
import dev.sidecar.v1.CompletionChunk;
import io.micrometer.observation.Observation;
import io.micrometer.observation.ObservationRegistry;
import io.micrometer.observation.contextpropagation.ObservationThreadLocalAccessor;
import java.util.Objects;
import java.util.concurrent.atomic.AtomicBoolean;
import org.springframework.ai.chat.model.ChatModel;
import org.springframework.ai.chat.model.ChatResponse;
import org.springframework.ai.chat.model.MessageAggregator;
import org.springframework.ai.chat.observation.ChatModelObservationContext;
import org.springframework.ai.chat.observation.ChatModelObservationConvention;
import org.springframework.ai.chat.observation.ChatModelObservationDocumentation;
import org.springframework.ai.chat.observation.DefaultChatModelObservationConvention;
import org.springframework.ai.chat.prompt.ChatOptions;
import org.springframework.ai.chat.prompt.Prompt;
import org.springframework.ai.model.tool.ToolCallingManager;
import reactor.core.publisher.Flux;

/**
 * Spring AI {@link ChatModel} (blocking and streaming) over the sidecar's Chat RPCs.
 *
 * <p>Each {@link ChatResponse} carries usage (prompt, completion, total; prompt tokens served from the
 * prefix cache as {@code getCacheReadInputTokens()}; the wire {@code Usage} as native usage), the finish reason ("STOP", "LENGTH", "ABORT") and,
 * in both the response and the generation metadata, the keys below (cache status and
 * similarity, prefix-cached tokens, timings). Failures are Spring AI's
 * {@link org.springframework.ai.retry.TransientAiException} /
 * {@link org.springframework.ai.retry.NonTransientAiException} with the client's typed
 * {@link dev.sidecar.client.SidecarException} as cause (see {@link SpringAiErrors}).
 * {@link SidecarChatOptions#getTimeout()} is the call's deadline.
 *
 * <p>Calls are observed with Spring AI's chat-model observation (gen_ai.* key values).
 * A stream's observation is a child of the observation in the subscriber's Reactor
 * context (e.g. ChatClient's), is itself put in the context of the stream, records the whole
 * answer (Spring AI's {@link MessageAggregator}: all deltas and tool calls, the last chunk's usage
 * and finish reason) when the stream completes, and is stopped however the stream ends
 * (completed, failed or cancelled). The gRPC call is started with the chat observation in
 * scope, so the client's gRPC observation (if any) is its child.
 *
 * <p>Tools: the options' tool callbacks are resolved to definitions (name, description, input
 * schema) through the {@link ToolCallingManager} and sent as {@code ChatRequest.tools}; the
 * model's calls come back as {@link org.springframework.ai.chat.messages.AssistantMessage.ToolCall}s
 * with finish reason "TOOL_CALLS" (in a stream each call arrives whole in one chunk). As with
 * Spring AI 2.0's own chat models, the calls are executed by ChatClient's tool-calling advisor
 * (Spring AI's {@code ToolCallingManager}, its eligibility checker, {@code returnDirect} and call
 * limits), which sends the assistant calls and the {@code ToolResponseMessage} back here; a bare
 * {@code call(prompt)} returns the calls to its caller. Native structured output (the options'
 * output schema) is sent as a JSON-schema response format. With either, an unset max tokens
 * lets the sidecar generate up to the rest of the context instead of its 64-token default, so
 * JSON is not cut short.
 *
 * <p>Built with {@link #builder()}: {@code SidecarChatModel.builder().client(client).build()}.
 */
public class SidecarChatModel implements ChatModel {

    public static final String CACHE_STATUS = "sidecar.cache.status";
    /**
     * Assistant-message metadata key of a thinking model's reasoning (the key Spring AI's OpenAI chat model
     * uses for {@code reasoning_content}); in a stream, each chunk's message carries its part.
     */
    public static final String REASONING_CONTENT = "reasoningContent";
    /** Response and generation metadata key: completion tokens the model spent reasoning. */
    public static final String REASONING_TOKENS = "sidecar.reasoning.tokens";
    public static final String CACHE_SIMILARITY = "sidecar.cache.similarity";
    public static final String CACHE_MATCHED_QUERY = "sidecar.cache.matched-query";
    public static final String CACHE_BYPASS_REASON = "sidecar.cache.bypass-reason";
    public static final String CACHED_TOKENS = "sidecar.usage.cached-tokens";
    public static final String TTFT_MS = "sidecar.timing.ttft-ms";
    public static final String TOTAL_MS = "sidecar.timing.total-ms";
    public static final String QUEUE_MS = "sidecar.timing.queue-ms";

    /** The provider name in observations, and the value of {@code spring.ai.model.chat} selecting this model. */
    public static final String PROVIDER = "sidecar";
    private static final ChatModelObservationConvention DEFAULT_CONVENTION =
            new DefaultChatModelObservationConvention();

    private final SidecarClient client;
    private final SidecarChatOptions defaultOptions;
    private final ObservationRegistry observationRegistry;
    private final ToolCallingManager toolCallingManager;
    private ChatModelObservationConvention observationConvention;

    private SidecarChatModel(Builder b) {
        this.client = Objects.requireNonNull(b.client, "client");
        this.defaultOptions = b.defaultOptions == null ? SidecarChatOptions.builder().build() : b.defaultOptions.copy();
        this.observationRegistry = b.observationRegistry == null ? ObservationRegistry.NOOP : b.observationRegistry;
        this.toolCallingManager = b.toolCallingManager == null ? ToolCallingManager.builder().build()
                : b.toolCallingManager;
        this.observationConvention = b.observationConvention;
    }

    public static Builder builder() {
        return new Builder();
    }

    /** Replaces the default chat observation convention (null restores it). */
    public void setObservationConvention(ChatModelObservationConvention convention) {
        this.observationConvention = convention;
    }

    /**
     * This model's default options: what ChatClient starts from (through {@code mutate()}) before
     * combining a call's own options, so the sidecar fields survive the combination.
     */
    @Override
    public ChatOptions getOptions() {
        return defaultOptions.copy();
    }

    @Override
    public ChatResponse call(Prompt prompt) {
        Prompt effective = effectivePrompt(prompt);
        SidecarChatOptions options = (SidecarChatOptions) effective.getOptions();
        ChatRequest request = ChatMapping.toRequest(effective, options,
                toolCallingManager.resolveToolDefinitions(options));
        ChatModelObservationContext context = observationContext(effective, false);
        return observation(context).observe(() -> {
            ChatResponse response;
            try {
                response = ChatMapping.toResponse(
                        SessionAffinity.call(options.getSessionId(), () -> client.chat(request, options.getTimeout())));
            } catch (RuntimeException e) {
                throw SpringAiErrors.translate(e);
            }
            context.setResponse(response);
            return response;
        });
    }

    @Override
    public Flux<ChatResponse> stream(Prompt prompt) {
        Prompt effective = effectivePrompt(prompt);
        SidecarChatOptions options = (SidecarChatOptions) effective.getOptions();
        ChatRequest request = ChatMapping.toRequest(effective, options,
                toolCallingManager.resolveToolDefinitions(options));
        String model = options.getModel();
        return Flux.deferContextual(contextView -> {
            ChatModelObservationContext context = observationContext(effective, true);
            Observation observation = observation(context);
            Observation parent = contextView.getOrDefault(ObservationThreadLocalAccessor.KEY, null);
            if (parent != null) {
                observation.parentObservation(parent);
            }
            // Started with the parent in scope, so a tracer derives the span's parent from
            // it rather than from whatever happens to be current on the subscribing thread.
            try (Observation.Scope ignored = parent != null ? parent.openScope() : Observation.Scope.NOOP) {
                observation.start();
            }
            Flux<CompletionChunk> call = SessionAffinity.flux(options.getSessionId(),
                    () -> client.chatStream(request, options.getTimeout()));
            // The gRPC call starts when subscribed: subscribing with this observation in scope
            // makes it the parent of the call's own observation (gRPC client interceptor).
            Flux<ChatResponse> responses = Flux.<CompletionChunk>from(subscriber -> {
                try (Observation.Scope ignored = observation.openScope()) {
                    call.subscribe(subscriber);
                }
            }).map(chunk -> ChatMapping.toResponse(chunk, model)).onErrorMap(SpringAiErrors::translate);
            AtomicBoolean stopped = new AtomicBoolean();  // complete, error and cancel race on cancellation
            Runnable stop = () -> {
                if (stopped.compareAndSet(false, true)) {
                    observation.stop();
                }
            };
            // Stopped before the terminal signal travels downstream (not in doFinally, which runs
            // after it): when the subscriber sees the end, the observation holds the whole answer.
            return new MessageAggregator().aggregate(responses, context::setResponse)
                    .doOnComplete(stop)
                    .doOnError(e -> {
                        observation.error(e);
                        stop.run();
                    })
                    .doOnCancel(stop)
                    .contextWrite(ctx -> ctx.put(ObservationThreadLocalAccessor.KEY, observation));
        });
    }

    /** The prompt with its options merged over this model's defaults. */
    Prompt effectivePrompt(Prompt prompt) {
        SidecarChatOptions merged = SidecarChatOptions.merge(defaultOptions, prompt.getOptions());
        return new Prompt(prompt.getInstructions(), merged);
    }

    private ChatModelObservationContext observationContext(Prompt prompt, boolean streaming) {
        return ChatModelObservationContext.builder().prompt(prompt).provider(PROVIDER).streaming(streaming).build();
    }

    private Observation observation(ChatModelObservationContext context) {
        return ChatModelObservationDocumentation.CHAT_MODEL_OPERATION.observation(observationConvention,
                DEFAULT_CONVENTION, () -> context, observationRegistry);
    }

    /** Builds a {@link SidecarChatModel}; only the client is required. */
    public static final class Builder {

        private SidecarClient client;
        private SidecarChatOptions defaultOptions;
        private ObservationRegistry observationRegistry;
        private ToolCallingManager toolCallingManager;
        private ChatModelObservationConvention observationConvention;

        private Builder() {
        }

        public Builder client(SidecarClient client) {
            this.client = client;
            return this;
        }

        /** Options every call starts from (copied); default: the sidecar's own defaults. */
        public Builder defaultOptions(SidecarChatOptions defaultOptions) {
            this.defaultOptions = defaultOptions;
            return this;
        }

        /** Default: {@link ObservationRegistry#NOOP}. */
        public Builder observationRegistry(ObservationRegistry observationRegistry) {
            this.observationRegistry = observationRegistry;
            return this;
        }

        /** Resolves the options' tool callbacks to the definitions sent; default: Spring AI's manager. */
        public Builder toolCallingManager(ToolCallingManager toolCallingManager) {
            this.toolCallingManager = toolCallingManager;
            return this;
        }

        /** Default: Spring AI's {@link DefaultChatModelObservationConvention}. */
        public Builder observationConvention(ChatModelObservationConvention observationConvention) {
            this.observationConvention = observationConvention;
            return this;
        }

        public SidecarChatModel build() {
            return new SidecarChatModel(this);
        }
    }
}
