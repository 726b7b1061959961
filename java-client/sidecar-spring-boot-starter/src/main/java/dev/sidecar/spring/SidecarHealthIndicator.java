package dev.sidecar.spring;

import dev.sidecar.client.SidecarClient;
import io.grpc.StatusRuntimeException;
import io.grpc.health.v1.HealthCheckRequest;
import io.grpc.health.v1.HealthCheckResponse;
import io.grpc.health.v1.HealthGrpc;
import java.time.Duration;
import java.util.concurrent.TimeUnit;
import org.springframework.boot.health.contributor.AbstractHealthIndicator;
import org.springframework.boot.health.contributor.Health;

/**
 * Reports the sidecar's standard {@code grpc.health.v1.Health} status for
 * {@code sidecar.v1.Inference}: UP when SERVING, OUT_OF_SERVICE while it loads or
 * drains, DOWN when unreachable.
 */
public class SidecarHealthIndicator extends AbstractHealthIndicator {

    static final String SERVICE = "sidecar.v1.Inference";

    private final SidecarClient client;
    private final Duration timeout;

    public SidecarHealthIndicator(SidecarClient client, Duration timeout) {
        super("Sidecar health check failed");
        this.client = client;
        this.timeout = timeout;
    }

    @Override
    protected void doHealthCheck(Health.Builder builder) {
        try {
            HealthCheckResponse r = HealthGrpc.newBlockingStub(client.channel())
                    .withDeadlineAfter(timeout.toMillis(), TimeUnit.MILLISECONDS)
                    .check(HealthCheckRequest.newBuilder().setService(SERVICE).build());
            HealthCheckResponse.ServingStatus status = r.getStatus();
            (status == HealthCheckResponse.ServingStatus.SERVING ? builder.up() : builder.outOfService())
                    .withDetail("status", status.name());
        } catch (StatusRuntimeException e) {
            builder.down().withDetail("status", e.getStatus().getCode().name())
                    .withDetail("error", String.valueOf(e.getStatus().getDescription()));
        }
    }
}
