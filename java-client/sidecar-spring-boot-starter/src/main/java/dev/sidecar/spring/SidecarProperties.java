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

    /**
     * API key sent as {@code authorization: Bearer <key>}; empty sends none. A tenant key
     * ({@code --api-key}) or an operator key ({@code --admin-key}), which may also load and unload
     * adapters through the client bean ({@code SidecarClient.loadLoraAdapter}).
     */
    private String apiKey;

    /** Deadline of every unary call (chat, generate, embed, ...); empty or zero means none. */
    private Duration deadline = Duration.ofSeconds(60);

    /**
     * Deadline of every streaming call, counted from subscription (a long answer streams for
     * longer than a unary call waits); empty or zero means none. A prompt's
     * {@code SidecarChatOptions.timeout} overrides both.
     */
    private Duration streamDeadline = Duration.ofMinutes(5);

    /**
     * Interval of HTTP/2 keepalive pings on a connection with calls in flight (at least 10 s,
     * the sidecar's minimum), so a replica that vanished without closing its connections is
     * detected; empty or zero disables keepalive.
     */
    private Duration keepAliveTime = Duration.ofSeconds(30);

    /** How long a keepalive ping may go unanswered before the connection is dropped. */
    private Duration keepAliveTimeout = Duration.ofSeconds(10);

    /** Also send keepalive pings while no call is running. */
    private boolean keepAliveWithoutCalls;

    /**
     * After this long without calls the channel drops its connections and re-resolves the
     * target on the next call; empty means gRPC's default (30 minutes).
     */
    private Duration idleTimeout;

    /**
     * Client-side health checking: calls go only to replicas whose grpc.health.v1 status for
     * sidecar.v1.Inference is SERVING, so a loading or draining replica gets none. Recommended
     * with a dns:/// target over several replicas.
     */
    private boolean healthCheck;

    /**
     * Load-balancing policy over the target's addresses: {@code round_robin}, or
     * {@code sidecar_session_affinity} to keep each chat session (SidecarChatOptions.sessionId) on one replica.
     */
    private String loadBalancingPolicy = "round_robin";

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

        /** Most tokens to generate; empty means the sidecar's default. */
        private Integer maxTokens;

        /** Sampling temperature (0 = greedy); empty means the sidecar's default. */
        private Double temperature;

        /** Nucleus sampling probability mass, in (0, 1]. */
        private Double topP;

        /** Sample only among the k most likely tokens (0 = all). */
        private Integer topK;

        /** Seed of the request's sampler, for reproducible sampled answers. */
        private Long seed;

        /** Stop sequences: generation ends before any of them. */
        private List<String> stop = new ArrayList<>();

        /** Deadline of each chat call (unary or stream); empty means sidecar.client.deadline / stream-deadline. */
        private Duration timeout;

        public Duration getTimeout() {
            return timeout;
        }

        public void setTimeout(Duration timeout) {
            this.timeout = timeout;
        }

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
                    .topP(topP).topK(topK).seed(seed).stop(stop.isEmpty() ? null : List.copyOf(stop))
                    .timeout(timeout == null || timeout.isZero() ? null : timeout).build();
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

    public Duration getStreamDeadline() {
        return streamDeadline;
    }

    public void setStreamDeadline(Duration streamDeadline) {
        this.streamDeadline = streamDeadline;
    }

    public Duration getKeepAliveTime() {
        return keepAliveTime;
    }

    public void setKeepAliveTime(Duration keepAliveTime) {
        this.keepAliveTime = keepAliveTime;
    }

    public Duration getKeepAliveTimeout() {
        return keepAliveTimeout;
    }

    public void setKeepAliveTimeout(Duration keepAliveTimeout) {
        this.keepAliveTimeout = keepAliveTimeout;
    }

    public boolean isKeepAliveWithoutCalls() {
        return keepAliveWithoutCalls;
    }

    public void setKeepAliveWithoutCalls(boolean keepAliveWithoutCalls) {
        this.keepAliveWithoutCalls = keepAliveWithoutCalls;
    }

    public Duration getIdleTimeout() {
        return idleTimeout;
    }

    public void setIdleTimeout(Duration idleTimeout) {
        this.idleTimeout = idleTimeout;
    }

    public boolean isHealthCheck() {
        return healthCheck;
    }

    public void setHealthCheck(boolean healthCheck) {
        this.healthCheck = healthCheck;
    }

    public String getLoadBalancingPolicy() {
        return loadBalancingPolicy;
    }

    public void setLoadBalancingPolicy(String loadBalancingPolicy) {
        this.loadBalancingPolicy = loadBalancingPolicy;
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
