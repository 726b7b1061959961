package dev.sidecar.spring;

import dev.sidecar.v1.CacheControl;
import dev.sidecar.v1.ResponseFormat;
import dev.sidecar.v1.ToolChoice;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import org.springframework.ai.chat.prompt.ChatOptions;
import org.springframework.ai.chat.prompt.DefaultChatOptionsBuilder;
import org.springframework.ai.model.tool.StructuredOutputChatOptions;
import org.springframework.ai.model.tool.ToolCallingChatOptions;
import org.springframework.ai.tool.ToolCallback;

/**
 * Per-call options of {@link SidecarChatModel}. Unset (null) fields fall back to the
 * model's defaults, then to the sidecar's. Generic {@link ChatOptions} from other code
 * (e.g. {@code ChatOptions.builder().temperature(0.2)}) are honoured as well.
 *
 * <p>A {@link ToolCallingChatOptions}: {@code ChatClient...tools(obj)} attaches the tools here,
 * and the model sends their definitions to the sidecar; ChatClient's tool-calling advisor runs
 * the calls through Spring AI's {@code ToolCallingManager}. A {@link StructuredOutputChatOptions}:
 * with native structured output ChatClient puts the target type's JSON schema in
 * {@link #getOutputSchema()}, sent as a JSON-schema response format (guided decoding).
 * {@link #getToolChoice()}, {@link #getParallelToolCalls()} and {@link #getResponseFormat()}
 * are the sidecar's {@code ChatRequest} fields of the same names.
 *
 * <p>{@link #getTimeout()} is the call's gRPC deadline (a stream's counts from
 * subscription); unset, the client's default for unary calls or streams applies.
 * Instances are immutable: change one through {@link #mutate()}.
 */
public class SidecarChatOptions implements ToolCallingChatOptions, StructuredOutputChatOptions {

    private final String model;
    private final Integer maxTokens;
    private final Double temperature;
    private final Double topP;
    private final Integer topK;
    private final Double minP;
    private final Double frequencyPenalty;
    private final Double presencePenalty;
    private final Double repetitionPenalty;
    private final Long seed;
    private final Integer beamWidth;
    private final List<String> stop;
    private final CacheControl cacheControl;
    private final String cacheSalt;
    private final Integer priority;
    private final Duration timeout;
    private final List<ToolCallback> toolCallbacks;
    private final Map<String, Object> toolContext;
    private final ToolChoice toolChoice;
    private final Boolean parallelToolCalls;
    private final ResponseFormat responseFormat;
    private final String outputSchema;
    private final String sessionId;
    private final Map<String, Integer> logitBias;
    private final String reasoningEffort;

    /** The generic fields come separately: they are the Spring AI builder's, protected in its package. */
    protected SidecarChatOptions(Builder b, String model, Integer maxTokens, Double temperature, Double topP,
                                 Integer topK, Double frequencyPenalty, Double presencePenalty, List<String> stop) {
        this.model = model;
        this.maxTokens = maxTokens;
        this.temperature = temperature;
        this.topP = topP;
        this.topK = topK;
        this.minP = b.minP;
        this.frequencyPenalty = frequencyPenalty;
        this.presencePenalty = presencePenalty;
        this.repetitionPenalty = b.repetitionPenalty;
        this.seed = b.seed;
        this.beamWidth = b.beamWidth;
        this.stop = stop == null ? null : List.copyOf(stop);
        this.cacheControl = b.cacheControl;
        this.cacheSalt = b.cacheSalt;
        this.priority = b.priority;
        this.timeout = b.timeout;
        this.toolCallbacks = List.copyOf(b.toolCallbacks);
        ToolCallingChatOptions.validateToolCallbacks(this.toolCallbacks);
        // Values may be null (Map.copyOf refuses them); the map itself is never exposed mutable.
        this.toolContext = java.util.Collections.unmodifiableMap(new LinkedHashMap<>(b.toolContext));
        this.toolChoice = b.toolChoice;
        this.parallelToolCalls = b.parallelToolCalls;
        this.responseFormat = b.responseFormat;
        this.outputSchema = b.outputSchema;
        this.sessionId = b.sessionId;
        this.logitBias = b.logitBias == null ? null
                : java.util.Collections.unmodifiableMap(new LinkedHashMap<>(b.logitBias));
        this.reasoningEffort = b.reasoningEffort;
    }

    public static Builder builder() {
        return new Builder();
    }

    /**
     * Overlays {@code override}'s set fields on {@code base}; either may be null. Unlike
     * Spring AI's {@code combineWith}, a set stop list replaces the base's. Tool callbacks: the
     * override's when it has any, else the base's; tool contexts are merged (override wins per
     * key). Sidecar-only fields are taken only when {@code override} is a SidecarChatOptions;
     * tool callbacks and context from any {@link ToolCallingChatOptions}, the output schema from
     * any {@link StructuredOutputChatOptions}.
     */
    public static SidecarChatOptions merge(SidecarChatOptions base, ChatOptions override) {
        SidecarChatOptions b = base == null ? builder().build() : base;
        if (override == null) {
            return b.copy();
        }
        Builder r = b.mutate()
                .model(pick(override.getModel(), b.model))
                .maxTokens(pick(override.getMaxTokens(), b.maxTokens))
                .temperature(pick(override.getTemperature(), b.temperature))
                .topP(pick(override.getTopP(), b.topP))
                .topK(pick(override.getTopK(), b.topK))
                .frequencyPenalty(pick(override.getFrequencyPenalty(), b.frequencyPenalty))
                .presencePenalty(pick(override.getPresencePenalty(), b.presencePenalty))
                .stopSequences(pick(override.getStopSequences(), b.stop));
        r.overlayPortable(override);
        if (override instanceof SidecarChatOptions s) {
            r.overlaySidecarFields(s);
        }
        return r.build();
    }

    private static <T> T pick(T preferred, T fallback) {
        return preferred != null ? preferred : fallback;
    }

    @Override
    public String getModel() {
        return model;
    }

    @Override
    public Integer getMaxTokens() {
        return maxTokens;
    }

    @Override
    public Double getTemperature() {
        return temperature;
    }

    @Override
    public Double getTopP() {
        return topP;
    }

    @Override
    public Integer getTopK() {
        return topK;
    }

    @Override
    public Double getFrequencyPenalty() {
        return frequencyPenalty;
    }

    @Override
    public Double getPresencePenalty() {
        return presencePenalty;
    }

    @Override
    public List<String> getStopSequences() {
        return stop;
    }

    public Double getMinP() {
        return minP;
    }

    /**
     * OpenAI's {@code logit_bias}: token id (decimal text, as Spring AI's OpenAI options key it) to a bias in
     * [-100, 100] added to that token's logit; +100 all but forces the token, -100 bans it.
     */
    public Map<String, Integer> getLogitBias() {
        return logitBias;
    }

    /**
     * OpenAI's {@code reasoning_effort} for a thinking model: "none" / "minimal" turn thinking off, "low" /
     * "medium" / "high" on; a model that does not think ignores it. The reasoning comes back in the
     * assistant message's metadata under {@link SidecarChatModel#REASONING_CONTENT}.
     */
    public String getReasoningEffort() {
        return reasoningEffort;
    }

    public Double getRepetitionPenalty() {
        return repetitionPenalty;
    }

    public Long getSeed() {
        return seed;
    }

    /** Beam search with this many beams (the reply is the best hypothesis); null: sampling. */
    public Integer getBeamWidth() {
        return beamWidth;
    }

    public CacheControl getCacheControl() {
        return cacheControl;
    }

    public String getCacheSalt() {
        return cacheSalt;
    }

    public Integer getPriority() {
        return priority;
    }

    /**
     * The conversation's affinity key: with the {@code sidecar_session_affinity} load-balancing policy
     * every call carrying it goes to the same READY replica (whose prefix cache holds the earlier turns).
     */
    public String getSessionId() {
        return sessionId;
    }

    /** The call's deadline; null means the client's default (unary or stream). */
    public Duration getTimeout() {
        return timeout;
    }

    /** The tools offered to the model (never null; empty when none). */
    @Override
    public List<ToolCallback> getToolCallbacks() {
        return toolCallbacks;
    }

    /** Values handed to the tools when ChatClient runs them (never null). */
    @Override
    public Map<String, Object> getToolContext() {
        return toolContext;
    }

    /**
     * Whether and which tool the model must call; null: the sidecar's default (auto when tools are
     * given). A forced choice (required, a named function) applies to turns that ask; the turn that
     * carries the tools' results (the prompt ends with a tool message) is sent as auto, so
     * ChatClient's tool loop ends with an answer.
     */
    public ToolChoice getToolChoice() {
        return toolChoice;
    }

    /** Whether one reply may hold more than one call; null: the sidecar's default (true). */
    public Boolean getParallelToolCalls() {
        return parallelToolCalls;
    }

    /** An explicit output constraint (JSON schema, JSON object, regex, choice); null: none. */
    public ResponseFormat getResponseFormat() {
        return responseFormat;
    }

    /** The JSON schema of native structured output (set by ChatClient's {@code .entity()}); null: none. */
    @Override
    public String getOutputSchema() {
        return outputSchema;
    }

    /** A builder holding this instance's values. */
    @Override
    public Builder mutate() {
        Builder b = builder().model(model).maxTokens(maxTokens).temperature(temperature).topP(topP).topK(topK)
                .frequencyPenalty(frequencyPenalty).presencePenalty(presencePenalty).stopSequences(stop)
                .toolCallbacks(toolCallbacks).toolContext(toolContext).outputSchema(outputSchema);
        b.overlaySidecarFields(this);
        return b;
    }

    /** An equal, independent instance. */
    public SidecarChatOptions copy() {
        return mutate().build();
    }

    @Override
    public boolean equals(Object o) {
        if (!(o instanceof SidecarChatOptions c)) {
            return false;
        }
        return Objects.equals(model, c.model) && Objects.equals(maxTokens, c.maxTokens)
                && Objects.equals(temperature, c.temperature) && Objects.equals(topP, c.topP)
                && Objects.equals(topK, c.topK) && Objects.equals(minP, c.minP)
                && Objects.equals(frequencyPenalty, c.frequencyPenalty)
                && Objects.equals(presencePenalty, c.presencePenalty)
                && Objects.equals(repetitionPenalty, c.repetitionPenalty) && Objects.equals(seed, c.seed)
                && Objects.equals(beamWidth, c.beamWidth)
                && Objects.equals(stop, c.stop) && cacheControl == c.cacheControl
                && Objects.equals(cacheSalt, c.cacheSalt) && Objects.equals(priority, c.priority)
                && Objects.equals(timeout, c.timeout) && Objects.equals(toolCallbacks, c.toolCallbacks)
                && Objects.equals(toolContext, c.toolContext) && Objects.equals(toolChoice, c.toolChoice)
                && Objects.equals(parallelToolCalls, c.parallelToolCalls)
                && Objects.equals(responseFormat, c.responseFormat) && Objects.equals(outputSchema, c.outputSchema)
                && Objects.equals(sessionId, c.sessionId) && Objects.equals(logitBias, c.logitBias)
                && Objects.equals(reasoningEffort, c.reasoningEffort);
    }

    @Override
    public int hashCode() {
        return Objects.hash(model, maxTokens, temperature, topP, topK, seed, beamWidth, stop, cacheControl, timeout,
                toolCallbacks, toolChoice, responseFormat, outputSchema);
    }

    @Override
    public String toString() {
        return "SidecarChatOptions{model=" + model + ", maxTokens=" + maxTokens + ", temperature=" + temperature
                + ", topP=" + topP + ", topK=" + topK + ", seed=" + seed + ", beamWidth=" + beamWidth + ", stop=" + stop
                + ", cacheControl=" + cacheControl + ", timeout=" + timeout
                + ", tools=" + toolCallbacks.stream().map(t -> t.getToolDefinition().name()).toList()
                + ", toolChoice=" + (toolChoice == null ? null : toolChoice.getMode() + ":" + toolChoice.getFunctionName())
                + ", parallelToolCalls=" + parallelToolCalls
                + ", responseFormat=" + (responseFormat == null ? null : responseFormat.getType())
                + ", outputSchema=" + (outputSchema != null) + "}";
    }

    /**
     * Builder of {@link SidecarChatOptions}; a Spring AI {@link ToolCallingChatOptions.Builder} and
     * {@link StructuredOutputChatOptions.Builder}, so {@code ChatClient...options(SidecarChatOptions.builder().seed(7L))},
     * {@code .tools(...)} and {@code .entity(...)} work and {@link #combineWith} carries the sidecar fields.
     */
    public static class Builder extends DefaultChatOptionsBuilder<Builder>
            implements ToolCallingChatOptions.Builder<Builder>, StructuredOutputChatOptions.Builder<Builder> {

        private Double minP;
        private Double repetitionPenalty;
        private Long seed;
        private Integer beamWidth;
        private CacheControl cacheControl;
        private String cacheSalt;
        private String sessionId;
        private Integer priority;
        private Duration timeout;
        private List<ToolCallback> toolCallbacks = new ArrayList<>();
        private Map<String, Object> toolContext = new LinkedHashMap<>();
        private ToolChoice toolChoice;
        private Boolean parallelToolCalls;
        private ResponseFormat responseFormat;
        private String outputSchema;
        private Map<String, Integer> logitBias;
        private String reasoningEffort;

        protected Builder() {
        }

        /** See {@link SidecarChatOptions#getLogitBias()}. */
        public Builder logitBias(Map<String, Integer> v) {
            this.logitBias = v;
            return self();
        }

        /** See {@link SidecarChatOptions#getReasoningEffort()}. */
        public Builder reasoningEffort(String v) {
            this.reasoningEffort = v;
            return self();
        }

        public Builder minP(Double v) {
            this.minP = v;
            return self();
        }

        public Builder repetitionPenalty(Double v) {
            this.repetitionPenalty = v;
            return self();
        }

        public Builder seed(Long v) {
            this.seed = v;
            return self();
        }

        /**
         * Beam search with {@code v} beams, sent as the request's {@code sampling.beam_width}; the sidecar
         * refuses it together with sampling options (temperature > 0, topP < 1, topK, seed, ...).
         */
        public Builder beamWidth(Integer v) {
            this.beamWidth = v;
            return self();
        }

        /** Same as {@link #stopSequences(List)}. */
        public Builder stop(List<String> v) {
            return stopSequences(v);
        }

        public Builder cacheControl(CacheControl v) {
            this.cacheControl = v;
            return self();
        }

        public Builder cacheSalt(String v) {
            this.cacheSalt = v;
            return self();
        }

        /** See {@link SidecarChatOptions#getSessionId()}; blank is refused. */
        public Builder sessionId(String v) {
            if (v != null && v.isBlank()) {
                throw new IllegalArgumentException("sessionId: must not be blank");
            }
            this.sessionId = v;
            return self();
        }

        public Builder priority(Integer v) {
            this.priority = v;
            return self();
        }

        /** The call's deadline (positive); null for the client's default. */
        public Builder timeout(Duration v) {
            if (v != null && (v.isNegative() || v.isZero())) {
                throw new IllegalArgumentException("timeout: must be positive, got " + v);
            }
            this.timeout = v;
            return self();
        }

        /** Replaces the tools (null: none). */
        @Override
        public Builder toolCallbacks(List<ToolCallback> v) {
            this.toolCallbacks = v == null ? new ArrayList<>() : new ArrayList<>(v);
            return self();
        }

        @Override
        public Builder toolCallbacks(ToolCallback... v) {
            return toolCallbacks(v == null ? null : Arrays.asList(v));
        }

        /** Replaces the tool context (null: empty). */
        @Override
        public Builder toolContext(Map<String, Object> v) {
            this.toolContext = v == null ? new LinkedHashMap<>() : new LinkedHashMap<>(v);
            return self();
        }

        @Override
        public Builder toolContext(String key, Object value) {
            this.toolContext.put(key, value);
            return self();
        }

        /** The sidecar's tool choice; null for its default (auto when tools are given). */
        public Builder toolChoice(ToolChoice v) {
            this.toolChoice = v;
            return self();
        }

        /** The model answers in text or calls tools (the default when tools are given). */
        public Builder toolChoiceAuto() {
            return toolChoice(ToolChoice.newBuilder().setMode(ToolChoice.Mode.MODE_AUTO).build());
        }

        /** The tools are not offered; text only. */
        public Builder toolChoiceNone() {
            return toolChoice(ToolChoice.newBuilder().setMode(ToolChoice.Mode.MODE_NONE).build());
        }

        /** At least one call to some tool, arguments valid for its schema (guaranteed by the grammar). */
        public Builder toolChoiceRequired() {
            return toolChoice(ToolChoice.newBuilder().setMode(ToolChoice.Mode.MODE_REQUIRED).build());
        }

        /** Exactly one call to the named tool, arguments valid for its schema. */
        public Builder toolChoiceFunction(String name) {
            if (name == null || name.isBlank()) {
                throw new IllegalArgumentException("toolChoice.functionName: must not be blank");
            }
            return toolChoice(ToolChoice.newBuilder().setMode(ToolChoice.Mode.MODE_FUNCTION).setFunctionName(name)
                    .build());
        }

        public Builder parallelToolCalls(Boolean v) {
            this.parallelToolCalls = v;
            return self();
        }

        /** An explicit output constraint (guided decoding); not together with {@link #outputSchema}. */
        public Builder responseFormat(ResponseFormat v) {
            this.responseFormat = v;
            return self();
        }

        /** The reply is JSON matching {@code schema} (JSON text); same as ChatClient's native structured output. */
        @Override
        public Builder outputSchema(String schema) {
            this.outputSchema = schema;
            return self();
        }

        /** Takes the tool callbacks, tool context and output schema of any Spring AI options that have them. */
        private void overlayPortable(ChatOptions o) {
            if (o instanceof ToolCallingChatOptions t) {
                if (t.getToolCallbacks() != null && !t.getToolCallbacks().isEmpty()) {
                    toolCallbacks(t.getToolCallbacks());
                }
                if (t.getToolContext() != null) {
                    toolContext(ToolCallingChatOptions.mergeToolContext(t.getToolContext(), this.toolContext));
                }
            }
            if (o instanceof StructuredOutputChatOptions s && s.getOutputSchema() != null) {
                this.outputSchema = s.getOutputSchema();
            }
        }

        private void overlaySidecarFields(SidecarChatOptions s) {
            this.minP = pick(s.minP, this.minP);
            this.repetitionPenalty = pick(s.repetitionPenalty, this.repetitionPenalty);
            this.seed = pick(s.seed, this.seed);
            this.beamWidth = pick(s.beamWidth, this.beamWidth);
            this.cacheControl = pick(s.cacheControl, this.cacheControl);
            this.cacheSalt = pick(s.cacheSalt, this.cacheSalt);
            this.sessionId = pick(s.sessionId, this.sessionId);
            this.priority = pick(s.priority, this.priority);
            this.timeout = pick(s.timeout, this.timeout);
            this.toolChoice = pick(s.toolChoice, this.toolChoice);
            this.parallelToolCalls = pick(s.parallelToolCalls, this.parallelToolCalls);
            this.responseFormat = pick(s.responseFormat, this.responseFormat);
            this.logitBias = pick(s.logitBias, this.logitBias);
            this.reasoningEffort = pick(s.reasoningEffort, this.reasoningEffort);
        }

        @Override
        public Builder clone() {
            Builder c = super.clone();
            c.toolCallbacks = new ArrayList<>(this.toolCallbacks);
            c.toolContext = new LinkedHashMap<>(this.toolContext);
            return c;
        }

        /**
         * Spring AI's combination (set generic fields of {@code other} win) plus the tools, tool
         * context and output schema of any tool-calling / structured-output builder, and the
         * sidecar fields of another SidecarChatOptions builder.
         */
        @Override
        public Builder combineWith(ChatOptions.Builder<?> other) {
            super.combineWith(other);
            if (other instanceof Builder that) {
                overlayPortable(that.build());
                overlaySidecarFields(that.build());
            } else if (other instanceof ToolCallingChatOptions.Builder<?>
                    || other instanceof StructuredOutputChatOptions.Builder<?>) {
                overlayPortable(other.clone().build());
            }
            return self();
        }

        @Override
        public SidecarChatOptions build() {
            return new SidecarChatOptions(this, model, maxTokens, temperature, topP, topK, frequencyPenalty,
                    presencePenalty, stopSequences);
        }
    }
}
