package dev.sidecar.spring;

import dev.sidecar.v1.CacheControl;
import java.util.List;
import java.util.Objects;
import org.springframework.ai.chat.prompt.ChatOptions;

/**
 * Per-call options of {@link SidecarChatModel}. Unset (null) fields fall back to the
 * model's defaults, then to the sidecar's. Generic {@link ChatOptions} from other code
 * (e.g. {@code ChatOptions.builder().temperature(0.2)}) are honoured as well.
 */
public class SidecarChatOptions implements ChatOptions {

    private String model;
    private Integer maxTokens;
    private Double temperature;
    private Double topP;
    private Integer topK;
    private Double minP;
    private Double frequencyPenalty;
    private Double presencePenalty;
    private Double repetitionPenalty;
    private Long seed;
    private List<String> stop;
    private CacheControl cacheControl;
    private String cacheSalt;
    private Integer priority;

    public static Builder builder() {
        return new Builder();
    }

    /**
     * Overlays {@code override}'s non-null fields on {@code base}; either may be null.
     * Sidecar-only fields are taken only when {@code override} is a SidecarChatOptions.
     */
    public static SidecarChatOptions merge(SidecarChatOptions base, ChatOptions override) {
        SidecarChatOptions r = base == null ? new SidecarChatOptions() : base.copy();
        if (override == null) {
            return r;
        }
        r.model = pick(override.getModel(), r.model);
        r.maxTokens = pick(override.getMaxTokens(), r.maxTokens);
        r.temperature = pick(override.getTemperature(), r.temperature);
        r.topP = pick(override.getTopP(), r.topP);
        r.topK = pick(override.getTopK(), r.topK);
        r.frequencyPenalty = pick(override.getFrequencyPenalty(), r.frequencyPenalty);
        r.presencePenalty = pick(override.getPresencePenalty(), r.presencePenalty);
        r.stop = pick(override.getStopSequences(), r.stop);
        if (override instanceof SidecarChatOptions s) {
            r.minP = pick(s.minP, r.minP);
            r.repetitionPenalty = pick(s.repetitionPenalty, r.repetitionPenalty);
            r.seed = pick(s.seed, r.seed);
            r.cacheControl = pick(s.cacheControl, r.cacheControl);
            r.cacheSalt = pick(s.cacheSalt, r.cacheSalt);
            r.priority = pick(s.priority, r.priority);
        }
        return r;
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

    @Override
    @SuppressWarnings("unchecked")
    public SidecarChatOptions copy() {
        SidecarChatOptions c = new SidecarChatOptions();
        c.model = model;
        c.maxTokens = maxTokens;
        c.temperature = temperature;
        c.topP = topP;
        c.topK = topK;
        c.minP = minP;
        c.frequencyPenalty = frequencyPenalty;
        c.presencePenalty = presencePenalty;
        c.repetitionPenalty = repetitionPenalty;
        c.seed = seed;
        c.stop = stop == null ? null : List.copyOf(stop);
        c.cacheControl = cacheControl;
        c.cacheSalt = cacheSalt;
        c.priority = priority;
        return c;
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
                && Objects.equals(cacheSalt, c.cacheSalt) && Objects.equals(priority, c.priority);
    }

    @Override
    public int hashCode() {
        return Objects.hash(model, maxTokens, temperature, topP, topK, seed, stop, cacheControl);
    }

    @Override
    public String toString() {
        return "SidecarChatOptions{model=" + model + ", maxTokens=" + maxTokens + ", temperature=" + temperature
                + ", topP=" + topP + ", topK=" + topK + ", seed=" + seed + ", stop=" + stop
                + ", cacheControl=" + cacheControl + "}";
    }

    public static final class Builder {

        private final SidecarChatOptions o = new SidecarChatOptions();

        public Builder model(String v) {
            o.model = v;
            return this;
        }

        public Builder maxTokens(Integer v) {
            o.maxTokens = v;
            return this;
        }

        public Builder temperature(Double v) {
            o.temperature = v;
            return this;
        }

        public Builder topP(Double v) {
            o.topP = v;
            return this;
        }

        public Builder topK(Integer v) {
            o.topK = v;
            return this;
        }

        public Builder minP(Double v) {
            o.minP = v;
            return this;
        }

        public Builder frequencyPenalty(Double v) {
            o.frequencyPenalty = v;
            return this;
        }

        public Builder presencePenalty(Double v) {
            o.presencePenalty = v;
            return this;
        }

        public Builder repetitionPenalty(Double v) {
            o.repetitionPenalty = v;
            return this;
        }

        public Builder seed(Long v) {
            o.seed = v;
            return this;
        }

        public Builder stop(List<String> v) {
            o.stop = v == null ? null : List.copyOf(v);
            return this;
        }

        public Builder cacheControl(CacheControl v) {
            o.cacheControl = v;
            return this;
        }

        public Builder cacheSalt(String v) {
            o.cacheSalt = v;
            return this;
        }

        public Builder priority(Integer v) {
            o.priority = v;
            return this;
        }

        public SidecarChatOptions build() {
            return o.copy();
        }
    }
}
