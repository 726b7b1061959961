package dev.sidecar.client;

import io.grpc.ChannelCredentials;
import io.grpc.ClientInterceptor;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;
import io.grpc.TlsChannelCredentials;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Objects;
import java.util.concurrent.TimeUnit;

/**
 * Configures a {@link SidecarClient}. Exactly one source of the channel is used, in this
 * order: an injected {@link #channel(ManagedChannel)} (not owned, no service config
 * applied), a {@link #channelBuilder(ManagedChannelBuilder)} (owned; the client's
 * service config, retries and limits are applied to it), or {@link #target(String)}.
 */
public final class SidecarClientBuilder {

    private String target = "localhost:50051";
    private boolean tls;
    private Path trustedCertificates;
    private String apiKey;
    private Duration defaultDeadline;
    private Duration defaultStreamDeadline;
    private boolean streamDeadlineSet;
    private Duration keepAliveTime;
    private Duration keepAliveTimeout;
    private boolean keepAliveWithoutCalls;
    private Duration idleTimeout;
    private boolean healthCheck;
    private int maxRetryAttempts = 3;
    private Duration retryInitialBackoff = Duration.ofMillis(100);
    private Duration retryMaxBackoff = Duration.ofSeconds(2);
    private String loadBalancingPolicy = "round_robin";
    private Integer maxInboundMessageSize;
    private Duration shutdownTimeout = Duration.ofSeconds(5);
    private final List<ClientInterceptor> interceptors = new ArrayList<>();
    private ManagedChannel channel;
    private ManagedChannelBuilder<?> channelBuilder;

    SidecarClientBuilder() {
    }

    /**
     * Where the sidecar listens: {@code host:port}, or a resolver URI such as
     * {@code dns:///sidecar.default.svc:50051}, whose addresses are balanced round-robin.
     */
    public SidecarClientBuilder target(String target) {
        if (target == null || target.isBlank()) {
            throw new IllegalArgumentException("target: must not be blank");
        }
        this.target = target.trim();
        return this;
    }

    /** Plaintext (the default) or TLS with the JVM's trusted roots. */
    public SidecarClientBuilder tls(boolean tls) {
        this.tls = tls;
        return this;
    }

    /** TLS trusting the PEM certificates in this file (implies {@code tls(true)}). */
    public SidecarClientBuilder trustedCertificates(Path pemFile) {
        this.trustedCertificates = Objects.requireNonNull(pemFile, "trustedCertificates");
        this.tls = true;
        return this;
    }

    /** Sent as {@code authorization: Bearer <key>} on every call; null or blank sends none. */
    public SidecarClientBuilder apiKey(String apiKey) {
        this.apiKey = apiKey == null || apiKey.isBlank() ? null : apiKey;
        return this;
    }

    /** Deadline applied to every call, counted from the call's start; null for none. */
    public SidecarClientBuilder defaultDeadline(Duration deadline) {
        if (deadline != null && (deadline.isNegative() || deadline.isZero())) {
            throw new IllegalArgumentException("defaultDeadline: must be positive, got " + deadline);
        }
        this.defaultDeadline = deadline;
        return this;
    }

    /**
     * Deadline of streaming calls ({@code chatStream}, {@code generateStream}), counted from
     * subscription; a generation streams for much longer than a unary call waits. Null means
     * streams have no deadline; never called, streams use {@link #defaultDeadline(Duration)}.
     */
    public SidecarClientBuilder defaultStreamDeadline(Duration deadline) {
        if (deadline != null && (deadline.isNegative() || deadline.isZero())) {
            throw new IllegalArgumentException("defaultStreamDeadline: must be positive, got " + deadline);
        }
        this.defaultStreamDeadline = deadline;
        this.streamDeadlineSet = true;
        return this;
    }

    /**
     * HTTP/2 keepalive pings on an idle transport every {@code time} (grpc-java raises
     * anything below 10 s to 10 s; the sidecar accepts a ping every 10 s), dropping the
     * connection when one is unanswered for {@code timeout}: a replica that vanished without
     * closing its connections is detected and calls go to the others. Null disables
     * keepalive (gRPC's default).
     */
    public SidecarClientBuilder keepAlive(Duration time, Duration timeout) {
        if (time != null && (time.isNegative() || time.isZero())) {
            throw new IllegalArgumentException("keepAliveTime: must be positive, got " + time);
        }
        if (timeout != null && (timeout.isNegative() || timeout.isZero())) {
            throw new IllegalArgumentException("keepAliveTimeout: must be positive, got " + timeout);
        }
        this.keepAliveTime = time;
        this.keepAliveTimeout = timeout;
        return this;
    }

    /** Also ping while no call is running (default false). */
    public SidecarClientBuilder keepAliveWithoutCalls(boolean enabled) {
        this.keepAliveWithoutCalls = enabled;
        return this;
    }

    /**
     * After this long without calls the channel closes its connections and re-resolves the
     * target on the next call. Null keeps gRPC's default (30 minutes).
     */
    public SidecarClientBuilder idleTimeout(Duration timeout) {
        if (timeout != null && (timeout.isNegative() || timeout.isZero())) {
            throw new IllegalArgumentException("idleTimeout: must be positive, got " + timeout);
        }
        this.idleTimeout = timeout;
        return this;
    }

    /**
     * Client-side health checking: each connection watches the server's
     * {@code grpc.health.v1.Health} status of {@code sidecar.v1.Inference}, and the load
     * balancer sends calls only to replicas reporting SERVING, so a draining or loading
     * replica gets none. Default false.
     */
    public SidecarClientBuilder healthCheck(boolean enabled) {
        this.healthCheck = enabled;
        return this;
    }

    /** Total attempts for a call that fails with UNAVAILABLE (1 disables retries). Default 3. */
    public SidecarClientBuilder maxRetryAttempts(int attempts) {
        if (attempts < 1 || attempts > 5) {
            throw new IllegalArgumentException("maxRetryAttempts: must be in [1, 5], got " + attempts);
        }
        this.maxRetryAttempts = attempts;
        return this;
    }

    /** Exponential retry backoff bounds (grpc-java adds jitter). Defaults 100 ms and 2 s. */
    public SidecarClientBuilder retryBackoff(Duration initial, Duration max) {
        if (initial == null || max == null || initial.isNegative() || initial.isZero() || max.compareTo(initial) < 0) {
            throw new IllegalArgumentException("retryBackoff: need 0 < initial <= max, got " + initial + ", " + max);
        }
        this.retryInitialBackoff = initial;
        this.retryMaxBackoff = max;
        return this;
    }

    /**
     * Load balancing policy name; default {@code round_robin}. {@code sidecar_session_affinity}
     * ({@link SessionAffinityLoadBalancerProvider#POLICY}) keeps each session on one replica
     * (see {@link SessionAffinity}) and balances calls without a session round-robin.
     */
    public SidecarClientBuilder loadBalancingPolicy(String policy) {
        if (policy == null || policy.isBlank()) {
            throw new IllegalArgumentException("loadBalancingPolicy: must not be blank");
        }
        this.loadBalancingPolicy = policy;
        return this;
    }

    /** Largest response message accepted, in bytes (gRPC's default is 4 MiB). */
    public SidecarClientBuilder maxInboundMessageSize(int bytes) {
        if (bytes <= 0) {
            throw new IllegalArgumentException("maxInboundMessageSize: must be > 0, got " + bytes);
        }
        this.maxInboundMessageSize = bytes;
        return this;
    }

    /** How long {@link SidecarClient#close()} waits for in-flight calls. Default 5 s. */
    public SidecarClientBuilder shutdownTimeout(Duration timeout) {
        if (timeout == null || timeout.isNegative()) {
            throw new IllegalArgumentException("shutdownTimeout: must be >= 0, got " + timeout);
        }
        this.shutdownTimeout = timeout;
        return this;
    }

    /** Adds an interceptor (e.g. metrics or tracing) applied to every call. */
    public SidecarClientBuilder interceptor(ClientInterceptor interceptor) {
        interceptors.add(Objects.requireNonNull(interceptor, "interceptor"));
        return this;
    }

    /** Uses this channel as is; the client does not shut it down. Mainly for tests. */
    public SidecarClientBuilder channel(ManagedChannel channel) {
        this.channel = Objects.requireNonNull(channel, "channel");
        return this;
    }

    /**
     * Builds the channel from this builder (e.g. an in-process or custom-transport one)
     * after applying the client's service config, retries and limits; the client owns
     * the resulting channel.
     */
    public SidecarClientBuilder channelBuilder(ManagedChannelBuilder<?> builder) {
        this.channelBuilder = Objects.requireNonNull(builder, "channelBuilder");
        return this;
    }

    public SidecarClient build() {
        List<ClientInterceptor> all = new ArrayList<>(interceptors);
        all.add(SessionAffinity.interceptor());  // a session's key reaches the sidecar_session_affinity balancer
        if (apiKey != null) {
            all.add(new BearerAuthInterceptor(apiKey));
        }
        Duration streamDeadline = streamDeadlineSet ? defaultStreamDeadline : defaultDeadline;
        if (channel != null) {
            return new SidecarClient(channel, false, all, defaultDeadline, streamDeadline, maxInboundMessageSize,
                    shutdownTimeout);
        }
        ManagedChannelBuilder<?> b = channelBuilder != null ? channelBuilder : Grpc.newChannelBuilder(target, credentials());
        configure(b);
        return new SidecarClient(b.build(), true, all, defaultDeadline, streamDeadline, maxInboundMessageSize,
                shutdownTimeout);
    }

    private void configure(ManagedChannelBuilder<?> b) {
        b.defaultServiceConfig(ServiceConfigs.build(loadBalancingPolicy, maxRetryAttempts,
                retryInitialBackoff, retryMaxBackoff, healthCheck));
        if (keepAliveTime != null) {
            b.keepAliveTime(keepAliveTime.toNanos(), TimeUnit.NANOSECONDS);
        }
        if (keepAliveTimeout != null) {
            b.keepAliveTimeout(keepAliveTimeout.toNanos(), TimeUnit.NANOSECONDS);
        }
        b.keepAliveWithoutCalls(keepAliveWithoutCalls);
        if (idleTimeout != null) {
            b.idleTimeout(idleTimeout.toNanos(), TimeUnit.NANOSECONDS);
        }
        if (maxRetryAttempts > 1) {
            b.enableRetry();
        } else {
            b.disableRetry();
        }
        if (maxInboundMessageSize != null) {
            b.maxInboundMessageSize(maxInboundMessageSize);
        }
    }

    private ChannelCredentials credentials() {
        if (!tls) {
            return InsecureChannelCredentials.create();
        }
        TlsChannelCredentials.Builder creds = TlsChannelCredentials.newBuilder();
        if (trustedCertificates != null) {
            try {
                creds.trustManager(trustedCertificates.toFile());
            } catch (IOException e) {
                throw new UncheckedIOException("trustedCertificates: cannot read " + trustedCertificates, e);
            }
        }
        return creds.build();
    }
}
