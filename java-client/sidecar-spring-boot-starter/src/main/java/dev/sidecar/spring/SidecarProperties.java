package dev.sidecar.spring;

import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import org.springframework.boot.context.properties.ConfigurationProperties;
import org.springframework.util.unit.DataSize;

/** Settings under {@code sidecar.client}. */
@ConfigurationProperties(prefix = SidecarProperties.PREFIX)
public class SidecarProperties {

    public static final String PREFIX = "sidecar.client";

    /** {@code host:port} or a resolver URI such as {@code dns:///sidecar:50051} (round-robin over its addresses). */
    private String target = "localhost:50051";

    /** API key sent as {@code authorization: Bearer <key>}; empty sends none. */
    private String apiKey;

    /** Deadline of every call; empty or zero means none. */
    private Duration deadline = Duration.ofSeconds(60);

    /** Use TLS (with the JVM's trusted roots unless trust-certificates is set). */
    private boolean tls;

    /** PEM file with the certificates to trust for TLS. */
    private String trustCertificates;

    /** Largest response message accepted. */
    private DataSize maxMessageSize = DataSize.ofMegabytes(16);

    /** Attempts for calls failing with UNAVAILABLE (1 disables retries). */
    private int maxRetryAttempts = 3;

    /** Timeout of the health indicator's gRPC health check. */
    private Duration healthTimeout = Duration.ofSeconds(2);

    /** Default options of chat calls (a prompt's own options override them). */
    private final Chat chat = new Chat();

    public static class Chat {

        /** Served model name; empty means the sidecar's model. */
        private String model;
        private Integer maxTokens;
        private Double temperature;
        private Double topP;
        private Integer topK;
        private Long seed;
        private List<String> stop = new ArrayList<>();

        public String getModel() {
            return model;
        }

        public void setModel(String model) {
            this.model = model;
        }

        public Integer getMaxTokens() {
            return maxTokens;
        }

        public void setMaxTokens(Integer maxTokens) {
            this.maxTokens = maxTokens;
        }

        public Double getTemperature() {
            return temperature;
        }

        public void setTemperature(Double temperature) {
            this.temperature = temperature;
        }

        public Double getTopP() {
            return topP;
        }

        public void setTopP(Double topP) {
            this.topP = topP;
        }

        public Integer getTopK() {
            return topK;
        }

        public void setTopK(Integer topK) {
            this.topK = topK;
        }

        public Long getSeed() {
            return seed;
        }

        public void setSeed(Long seed) {
            this.seed = seed;
        }

        public List<String> getStop() {
            return stop;
        }

        public void setStop(List<String> stop) {
            this.stop = stop;
        }

        SidecarChatOptions toOptions() {
            return SidecarChatOptions.builder().model(model).maxTokens(maxTokens).temperature(temperature)
                    .topP(topP).topK(topK).seed(seed).stop(stop.isEmpty() ? null : List.copyOf(stop)).build();
        }
    }

    public String getTarget() {
        return target;
    }

    public void setTarget(String target) {
        this.target = target;
    }

    public String getApiKey() {
        return apiKey;
    }

    public void setApiKey(String apiKey) {
        this.apiKey = apiKey;
    }

    public Duration getDeadline() {
        return deadline;
    }

    public void setDeadline(Duration deadline) {
        this.deadline = deadline;
    }

    public boolean isTls() {
        return tls;
    }

    public void setTls(boolean tls) {
        this.tls = tls;
    }

    public String getTrustCertificates() {
        return trustCertificates;
    }

    public void setTrustCertificates(String trustCertificates) {
        this.trustCertificates = trustCertificates;
    }

    public DataSize getMaxMessageSize() {
        return maxMessageSize;
    }

    public void setMaxMessageSize(DataSize maxMessageSize) {
        this.maxMessageSize = maxMessageSize;
    }

    public int getMaxRetryAttempts() {
        return maxRetryAttempts;
    }

    public void setMaxRetryAttempts(int maxRetryAttempts) {
        this.maxRetryAttempts = maxRetryAttempts;
    }

    public Duration getHealthTimeout() {
        return healthTimeout;
    }

    public void setHealthTimeout(Duration healthTimeout) {
        this.healthTimeout = healthTimeout;
    }

    public Chat getChat() {
        return chat;
    }
}
