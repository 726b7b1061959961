package dev.sidecar.spring;

import dev.sidecar.v1.CacheControl;
import java.time.Duration;
import java.util.List;
import java.util.Objects;
import org.springframework.ai.chat.prompt.ChatOptions;
import org.springframework.ai.chat.prompt.DefaultChatOptionsBuilder;

/**
 * Per-call options of {@link SidecarChatModel}. Unset (null) fields fall back to the
 * model's defaults, then to the sidecar's. Generic {@link ChatOptions} from other code
 * (e.g. {@code ChatOptions.builder().temperature(0.2)}) are honoured as well.
 *
 * <p>{@link #getTimeout()} is the call's gRPC deadline (a stream's counts from
 * subscription); unset, the client's default for unary calls or streams applies.
 * Instances are immutable: change one through {@link #mutate()}.
 */
public class SidecarChatOptions implements ChatOptions {

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
    private final List<String> stop;
    private final CacheControl cacheControl;
    private final String cacheSalt;
    private final Integer priority;
    private final Duration timeout;

    protected SidecarChatOptions(String model, Integer maxTokens, Double temperature, Double topP, Integer topK,
                                 Double minP, Double frequencyPenalty, Double presencePenalty,
                                 Double repetitionPenalty, Long seed, List<String> stop, CacheControl cacheControl,
                                 String cacheSalt, Integer priority, Duration timeout) {
        this.model = model;
        this.maxTokens = maxTokens;
        this.temperature = temperature;
        this.topP = topP;
        this.topK = topK;
        this.minP = minP;
        this.frequencyPenalty = frequencyPenalty;
        this.presencePenalty = presencePenalty;
        this.repetitionPenalty = repetitionPenalty;
        this.seed = seed;
        this.stop = stop == null ? null : List.copyOf(stop);
        this.cacheControl = cacheControl;
        this.cacheSalt = cacheSalt;
        this.priority = priority;
        this.timeout = timeout;
    }

    public static Builder builder() {
        return new Builder();
    }

    /**
     * Overlays {@code override}'s non-null fields on {@code base}; either may be null. Unlike
     * Spring AI's {@code combineWith}, a set stop list replaces the base's. Sidecar-only
     * fields are taken only when {@code override} is a SidecarChatOptions.
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
        if (override instanceof SidecarChatOptions s) {
            r.overlaySidecarFields(s.minP, s.repetitionPenalty, s.seed, s.cacheControl, s.cacheSalt, s.priority,
                    s.timeout);
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

    public Double getRepetitionPenalty() {
        return repetitionPenalty;
    }

    public Long getSeed() {
        return seed;
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

    /** The call's deadline; null means the client's default (unary or stream). */
    public Duration getTimeout() {
        return timeout;
    }

    /** A builder holding this instance's values. */
    @Override
    public Builder mutate() {
        Builder b = builder().model(model).maxTokens(maxTokens).temperature(temperature).topP(topP).topK(topK)
                .frequencyPenalty(frequencyPenalty).presencePenalty(presencePenalty).stopSequences(stop);
        b.overlaySidecarFields(minP, repetitionPenalty, seed, cacheControl, cacheSalt, priority, timeout);
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
                && Objects.equals(stop, c.stop) && cacheControl == c.cacheControl
                && Objects.equals(cacheSalt, c.cacheSalt) && Objects.equals(priority, c.priority)
                && Objects.equals(timeout, c.timeout);
    }

    @Override
    public int hashCode() {
        return Objects.hash(model, maxTokens, temperature, topP, topK, seed, stop, cacheControl, timeout);
    }

    @Override
    public String toString() {
        return "SidecarChatOptions{model=" + model + ", maxTokens=" + maxTokens + ", temperature=" + temperature
                + ", topP=" + topP + ", topK=" + topK + ", seed=" + seed + ", stop=" + stop
                + ", cacheControl=" + cacheControl + ", timeout=" + timeout + "}";
    }

    /**
     * Builder of {@link SidecarChatOptions}; a Spring AI {@link ChatOptions.Builder}, so
     * {@code ChatClient...options(SidecarChatOptions.builder().seed(7L))} works and
     * {@link #combineWith} carries the sidecar fields.
     */
    public static class Builder extends DefaultChatOptionsBuilder<Builder> {

        private Double minP;
        private Double repetitionPenalty;
        private Long seed;
        private CacheControl cacheControl;
        private String cacheSalt;
        private Integer priority;
        private Duration timeout;

        protected Builder() {
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

        private void overlaySidecarFields(Double minP, Double repetitionPenalty, Long seed, CacheControl cacheControl,
                                          String cacheSalt, Integer priority, Duration timeout) {
            this.minP = pick(minP, this.minP);
            this.repetitionPenalty = pick(repetitionPenalty, this.repetitionPenalty);
            this.seed = pick(seed, this.seed);
            this.cacheControl = pick(cacheControl, this.cacheControl);
            this.cacheSalt = pick(cacheSalt, this.cacheSalt);
            this.priority = pick(priority, this.priority);
            this.timeout = pick(timeout, this.timeout);
        }

        @Override
        public Builder combineWith(ChatOptions.Builder<?> other) {
            super.combineWith(other);
            if (other instanceof Builder that) {
                overlaySidecarFields(that.minP, that.repetitionPenalty, that.seed, that.cacheControl, that.cacheSalt,
                        that.priority, that.timeout);
            }
            return self();
        }

        @Override
        public SidecarChatOptions build() {
            return new SidecarChatOptions(model, maxTokens, temperature, topP, topK, minP, frequencyPenalty,
                    presencePenalty, repetitionPenalty, seed, stopSequences, cacheControl, cacheSalt, priority,
                    timeout);
        }
    }
}
