package dev.sidecar.client;

import static org.assertj.core.api.Assertions.assertThat;

import io.grpc.Grpc;
import io.grpc.InsecureServerCredentials;
import io.grpc.NameResolverProvider;
import io.grpc.NameResolverRegistry;
import io.grpc.Server;
import io.grpc.health.v1.HealthCheckResponse;
import io.grpc.protobuf.services.HealthStatusManager;
import java.net.InetSocketAddress;
import java.net.SocketAddress;
import java.util.List;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;

/**
 * Two replicas behind one name: the client's default policy spreads calls over both
 * (as it does for the addresses of a {@code dns:///} name). A resolver under a private
 * scheme stands in for DNS, which cannot return two ports for one host.
 */
class RoundRobinTest {

    private static final String SCHEME = "sidecar-rr-test";

    private final FakeInference a = new FakeInference();
    private final FakeInference b = new FakeInference();
    private final HealthStatusManager healthA = new HealthStatusManager();
    private final HealthStatusManager healthB = new HealthStatusManager();
    private Server serverA;
    private Server serverB;
    private NameResolverProvider provider;

    @BeforeEach
    void setUp() throws Exception {
        serverA = Grpc.newServerBuilderForPort(0, InsecureServerCredentials.create()).addService(a)
                .addService(healthA.getHealthService()).build().start();
        serverB = Grpc.newServerBuilderForPort(0, InsecureServerCredentials.create()).addService(b)
                .addService(healthB.getHealthService()).build().start();
        healthA.setStatus(ServiceConfigs.SERVICE, HealthCheckResponse.ServingStatus.SERVING);
        healthB.setStatus(ServiceConfigs.SERVICE, HealthCheckResponse.ServingStatus.SERVING);
        List<SocketAddress> addresses = List.of(new InetSocketAddress("127.0.0.1", serverA.getPort()),
                new InetSocketAddress("127.0.0.1", serverB.getPort()));
        provider = new StaticProvider(SCHEME, addresses);
        NameResolverRegistry.getDefaultRegistry().register(provider);
    }

    @AfterEach
    void tearDown() throws Exception {
        NameResolverRegistry.getDefaultRegistry().deregister(provider);
        serverA.shutdownNow().awaitTermination(5, TimeUnit.SECONDS);
        serverB.shutdownNow().awaitTermination(5, TimeUnit.SECONDS);
    }

    @Test
    void callsAreSpreadOverAllReplicas() {
        try (SidecarClient client = SidecarClient.builder().target(SCHEME + ":///sidecar").build()) {
            // pick_first would send every call to one replica; round_robin reaches both
            // once both connections are ready.
            for (int i = 0; i < 500 && (a.calls.get() < 3 || b.calls.get() < 3); i++) {
                client.stats();
            }
        }
        assertThat(a.calls.get()).isGreaterThanOrEqualTo(3);
        assertThat(b.calls.get()).isGreaterThanOrEqualTo(3);
    }

    @Test
    void withHealthCheckingADrainingReplicaGetsNoCalls() throws Exception {
        healthB.setStatus(ServiceConfigs.SERVICE, HealthCheckResponse.ServingStatus.NOT_SERVING);
        try (SidecarClient client = SidecarClient.builder().target(SCHEME + ":///sidecar").healthCheck(true)
                .build()) {
            for (int i = 0; i < 200; i++) {
                client.stats();
            }
            assertThat(a.calls.get()).isEqualTo(200);
            assertThat(b.calls.get()).isZero();

            // Serving again: the watch reports it and round_robin picks B again.
            healthB.setStatus(ServiceConfigs.SERVICE, HealthCheckResponse.ServingStatus.SERVING);
            for (int i = 0; i < 5000 && b.calls.get() < 3; i++) {
                client.stats();
                Thread.sleep(1);
            }
            assertThat(b.calls.get()).isGreaterThanOrEqualTo(3);
        }
    }

    @Test
    void withoutHealthCheckingANotServingReplicaStillGetsCalls() {
        healthB.setStatus(ServiceConfigs.SERVICE, HealthCheckResponse.ServingStatus.NOT_SERVING);
        try (SidecarClient client = SidecarClient.builder().target(SCHEME + ":///sidecar").build()) {
            for (int i = 0; i < 500 && b.calls.get() < 3; i++) {
                client.stats();
            }
        }
        assertThat(b.calls.get()).isGreaterThanOrEqualTo(3);
    }
}
