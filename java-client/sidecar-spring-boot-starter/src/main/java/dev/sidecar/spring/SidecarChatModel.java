package dev.sidecar.spring;

import dev.sidecar.client.SidecarClient;
import dev.sidecar.v1.ChatRequest;
import io.micrometer.observation.Observation;
import io.micrometer.observation.ObservationRegistry;
import java.util.concurrent.atomic.AtomicReference;
import org.springframework.ai.chat.model.ChatModel;
import org.springframework.ai.chat.model.ChatResponse;
import org.springframework.ai.chat.observation.ChatModelObservationContext;
import org.springframework.ai.chat.observation.ChatModelObservationConvention;
import org.springframework.ai.chat.observation.ChatModelObservationDocumentation;
import org.springframework.ai.chat.observation.DefaultChatModelObservationConvention;
import org.springframework.ai.chat.prompt.ChatOptions;
import org.springframework.ai.chat.prompt.Prompt;
import reactor.core.publisher.Flux;

/**
 * Spring AI {@link ChatModel} (blocking and streaming) over the sidecar's Chat RPCs.
 *
 * <p>Each {@link ChatResponse} carries usage (prompt, completion, total; the wire
 * {@code Usage} as native usage), the finish reason ("STOP", "LENGTH", "ABORT") and,
 * in both the response and the generation metadata, the keys below (cache status and
 * similarity, prefix-cached tokens, timings). Errors are the client's typed
 * {@link dev.sidecar.client.SidecarException}s. Calls are observed with Spring AI's
 * chat-model observation (gen_ai.* key values) on the given registry.
 */
public class SidecarChatModel implements ChatModel {

    public static final String CACHE_STATUS = "sidecar.cache.status";
    public static final String CACHE_SIMILARITY = "sidecar.cache.similarity";
    public static final String CACHE_MATCHED_QUERY = "sidecar.cache.matched-query";
    public static final String CACHE_BYPASS_REASON = "sidecar.cache.bypass-reason";
    public static final String CACHED_TOKENS = "sidecar.usage.cached-tokens";
    public static final String TTFT_MS = "sidecar.timing.ttft-ms";
    public static final String TOTAL_MS = "sidecar.timing.total-ms";
    public static final String QUEUE_MS = "sidecar.timing.queue-ms";

    static final String PROVIDER = "sidecar";
    private static final ChatModelObservationConvention DEFAULT_CONVENTION =
            new DefaultChatModelObservationConvention();

    private final SidecarClient client;
    private final SidecarChatOptions defaultOptions;
    private final ObservationRegistry observationRegistry;
    private ChatModelObservationConvention observationConvention;

    public SidecarChatModel(SidecarClient client) {
        this(client, SidecarChatOptions.builder().build(), ObservationRegistry.NOOP);
    }

    public SidecarChatModel(SidecarClient client, SidecarChatOptions defaultOptions,
                            ObservationRegistry observationRegistry) {
        this.client = client;
        this.defaultOptions = defaultOptions == null ? SidecarChatOptions.builder().build() : defaultOptions.copy();
        this.observationRegistry = observationRegistry == null ? ObservationRegistry.NOOP : observationRegistry;
    }

    /** Replaces the default chat observation convention. */
    public void setObservationConvention(ChatModelObservationConvention convention) {
        this.observationConvention = convention;
    }

    @Override
    public ChatOptions getDefaultOptions() {
        return defaultOptions.copy();
    }

    @Override
    public ChatResponse call(Prompt prompt) {
        Prompt effective = effectivePrompt(prompt);
        ChatRequest request = ChatMapping.toRequest(effective, (SidecarChatOptions) effective.getOptions());
        ChatModelObservationContext context = observationContext(effective);
        return observation(context).observe(() -> {
            ChatResponse response = ChatMapping.toResponse(client.chat(request));
            context.setResponse(response);
            return response;
        });
    }

    @Override
    public Flux<ChatResponse> stream(Prompt prompt) {
        Prompt effective = effectivePrompt(prompt);
        SidecarChatOptions options = (SidecarChatOptions) effective.getOptions();
        ChatRequest request = ChatMapping.toRequest(effective, options);
        String model = options.getModel();
        return Flux.defer(() -> {
            ChatModelObservationContext context = observationContext(effective);
            Observation observation = observation(context).start();
            // The last chunk carries usage and finish reason: it is what the observation reports.
            AtomicReference<ChatResponse> last = new AtomicReference<>();
            return client.chatStream(request)
                    .map(chunk -> ChatMapping.toResponse(chunk, model))
                    .doOnNext(last::set)
                    .doOnError(observation::error)
                    .doFinally(signal -> {
                        if (last.get() != null) {
                            context.setResponse(last.get());
                        }
                        observation.stop();
                    });
        });
    }

    /** The prompt with its options merged over this model's defaults. */
    Prompt effectivePrompt(Prompt prompt) {
        SidecarChatOptions merged = SidecarChatOptions.merge(defaultOptions, prompt.getOptions());
        return new Prompt(prompt.getInstructions(), merged);
    }

    private ChatModelObservationContext observationContext(Prompt prompt) {
        return ChatModelObservationContext.builder().prompt(prompt).provider(PROVIDER).build();
    }

    private Observation observation(ChatModelObservationContext context) {
        return ChatModelObservationDocumentation.CHAT_MODEL_OPERATION.observation(observationConvention,
                DEFAULT_CONVENTION, () -> context, observationRegistry);
    }
}
