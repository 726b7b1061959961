package dev.sidecar.client;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import dev.sidecar.v1.CompletionChunk;
import io.grpc.Grpc;
import io.grpc.InsecureServerCredentials;
import io.grpc.NameResolverProvider;
import io.grpc.NameResolverRegistry;
import io.grpc.Server;
import io.grpc.health.v1.HealthCheckResponse;
import io.grpc.protobuf.services.HealthStatusManager;
import java.net.InetSocketAddress;
import java.net.SocketAddress;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;

/**
 * Three replicas behind one name with the {@code sidecar_session_affinity} policy: every call of a
 * session lands on one replica, sessions spread over all three, calls without a session are
 * round-robin, and stopping a replica moves only the sessions it held.
 */
class SessionAffinityTest {

    private static final String SCHEME = "sidecar-affinity-test";
    private static final int SESSIONS = 60;

    private final List<FakeInference> fakes = List.of(new FakeInference(), new FakeInference(), new FakeInference());
    private final List<Server> servers = new ArrayList<>();
    private final List<HealthStatusManager> health = new ArrayList<>();
    private NameResolverProvider provider;

    @BeforeEach
    void setUp() throws Exception {
        List<SocketAddress> addresses = new ArrayList<>();
        for (FakeInference f : fakes) {
            HealthStatusManager h = new HealthStatusManager();
            h.setStatus(ServiceConfigs.SERVICE, HealthCheckResponse.ServingStatus.SERVING);
            health.add(h);
            Server s = Grpc.newServerBuilderForPort(0, InsecureServerCredentials.create()).addService(f)
                    .addService(h.getHealthService()).build().start();
            servers.add(s);
            addresses.add(new InetSocketAddress("127.0.0.1", s.getPort()));
        }
        provider = new StaticProvider(SCHEME, addresses);
        NameResolverRegistry.getDefaultRegistry().register(provider);
    }

    @AfterEach
    void tearDown() throws Exception {
        NameResolverRegistry.getDefaultRegistry().deregister(provider);
        for (Server s : servers) {
            s.shutdownNow().awaitTermination(5, TimeUnit.SECONDS);
        }
    }

    private SidecarClient client() {
        return SidecarClient.builder().target(SCHEME + ":///sidecar")
                .loadBalancingPolicy(SessionAffinityLoadBalancerProvider.POLICY).build();
    }

    /** The replica that served {@code calls} calls of one session, or -1 if they were split. */
    private int serve(SidecarClient client, String session, int calls) {
        int[] before = fakes.stream().mapToInt(f -> f.calls.get()).toArray();
        for (int i = 0; i < calls; i++) {
            SessionAffinity.call(session, client::stats);
        }
        for (int r = 0; r < fakes.size(); r++) {
            if (fakes.get(r).calls.get() - before[r] == calls) {
                return r;
            }
        }
        return -1;
    }

    private void awaitAllReady(SidecarClient client) {
        // Until all three connections are READY a session may land on a subset; wait for round-robin to reach all.
        for (int i = 0; i < 2000 && fakes.stream().anyMatch(f -> f.calls.get() == 0); i++) {
            client.stats();
        }
        assertThat(fakes).allMatch(f -> f.calls.get() > 0);
    }

    @Test
    void aSessionStaysOnOneReplicaAndOnlyAStoppedReplicasSessionsMove() throws Exception {
        try (SidecarClient client = client()) {
            awaitAllReady(client);
            Map<String, Integer> home = new HashMap<>();
            for (int s = 0; s < SESSIONS; s++) {
                int r = serve(client, "session-" + s, 5);
                assertThat(r).as("all calls of session-%d on one replica", s).isNotNegative();
                home.put("session-" + s, r);
            }
            for (int r = 0; r < 3; r++) {
                final int replica = r;
                assertThat(home.values().stream().filter(v -> v == replica).count())
                        .as("sessions on replica %d", r).isGreaterThanOrEqualTo(SESSIONS / 10);
            }
            // The same sessions again: same replicas (affinity is a function of the key and the READY set).
            for (var e : home.entrySet()) {
                assertThat(serve(client, e.getKey(), 2)).isEqualTo(e.getValue());
            }

            servers.get(2).shutdownNow().awaitTermination(5, TimeUnit.SECONDS);
            String moved = home.entrySet().stream().filter(e -> e.getValue() == 2).findFirst().orElseThrow().getKey();
            for (int i = 0; i < 200; i++) {  // until the balancer has seen replica 2 leave READY
                try {
                    if (serve(client, moved, 1) != 2) {
                        break;
                    }
                } catch (SidecarException e) {
                    // a call racing the shutdown may fail; the next one is re-picked
                }
                Thread.sleep(10);
            }
            int movedCount = 0;
            for (var e : home.entrySet()) {
                int now = serve(client, e.getKey(), 3);
                if (e.getValue() == 2) {
                    assertThat(now).as(e.getKey() + " left the stopped replica").isIn(0, 1);
                    movedCount++;
                } else {
                    assertThat(now).as(e.getKey() + " stays where it was").isEqualTo(e.getValue());
                }
            }
            assertThat(movedCount).isPositive();
        }
    }

    @Test
    void withHealthCheckingANotServingReplicaLosesItsSessionsUntilItServesAgain() throws Exception {
        try (SidecarClient client = SidecarClient.builder().target(SCHEME + ":///sidecar").healthCheck(true)
                .loadBalancingPolicy(SessionAffinityLoadBalancerProvider.POLICY).build()) {
            awaitAllReady(client);
            String session = null;
            for (int s = 0; session == null; s++) {
                if (serve(client, "hc-" + s, 1) == 1) {
                    session = "hc-" + s;
                }
            }
            health.get(1).setStatus(ServiceConfigs.SERVICE, HealthCheckResponse.ServingStatus.NOT_SERVING);
            int now = 1;
            for (int i = 0; i < 500 && now == 1; i++) {
                now = serve(client, session, 1);
                Thread.sleep(2);
            }
            assertThat(now).isIn(0, 2);
            assertThat(serve(client, session, 5)).isEqualTo(now);
            health.get(1).setStatus(ServiceConfigs.SERVICE, HealthCheckResponse.ServingStatus.SERVING);
            for (int i = 0; i < 500 && now != 1; i++) {
                now = serve(client, session, 1);
                Thread.sleep(2);
            }
            assertThat(now).isEqualTo(1);  // back on its ring position once SERVING
        }
    }

    @Test
    void callsWithoutASessionAreRoundRobin() {
        try (SidecarClient client = client()) {
            awaitAllReady(client);
            int[] before = fakes.stream().mapToInt(f -> f.calls.get()).toArray();
            for (int i = 0; i < 30; i++) {
                client.stats();
            }
            for (int r = 0; r < 3; r++) {
                assertThat(fakes.get(r).calls.get() - before[r]).isEqualTo(10);
            }
        }
    }

    @Test
    void aStreamCarriesItsSessionKey() {
        try (SidecarClient client = client()) {
            awaitAllReady(client);
            int[] before = fakes.stream().mapToInt(f -> f.calls.get()).toArray();
            for (int i = 0; i < 6; i++) {
                List<CompletionChunk> chunks = SessionAffinity.flux("stream-session",
                        () -> client.generateStream(dev.sidecar.v1.GenerateRequest.newBuilder().setPrompt("hi").build()))
                        .collectList().block();
                assertThat(chunks).isNotEmpty();
            }
            long replicasUsed = java.util.stream.IntStream.range(0, 3)
                    .filter(r -> fakes.get(r).calls.get() > before[r]).count();
            assertThat(replicasUsed).isEqualTo(1);
        }
    }

    @Test
    void aBlankKeyIsRefused() {
        assertThatThrownBy(() -> SessionAffinity.call(" ", () -> 1))
                .isInstanceOf(IllegalArgumentException.class).hasMessageContaining("affinity key");
    }

    @Test
    void ringPointsOfAReplicaDoNotDependOnTheOthers() {
        // Adding a replica takes only the keys whose next point is now one of its own: about 1/N.
        java.util.TreeMap<Long, Integer> three = new java.util.TreeMap<>();
        java.util.TreeMap<Long, Integer> four = new java.util.TreeMap<>();
        for (int r = 0; r < 4; r++) {
            for (int i = 0; i < SessionAffinityLoadBalancer.POINTS; i++) {
                long h = SessionAffinityLoadBalancer.hash("replica-" + r + "#" + i);
                if (r < 3) {
                    three.put(h, r);
                }
                four.put(h, r);
            }
        }
        int moved = 0;
        int keys = 10000;
        for (int k = 0; k < keys; k++) {
            long h = SessionAffinityLoadBalancer.hash("session-" + k);
            var a = three.ceilingEntry(h) != null ? three.ceilingEntry(h) : three.firstEntry();
            var b = four.ceilingEntry(h) != null ? four.ceilingEntry(h) : four.firstEntry();
            if (!a.getValue().equals(b.getValue())) {
                assertThat(b.getValue()).isEqualTo(3);  // keys only ever move to the new replica
                moved++;
            }
        }
        assertThat(moved).isBetween(keys / 4 - keys / 10, keys / 4 + keys / 10);
    }
}
