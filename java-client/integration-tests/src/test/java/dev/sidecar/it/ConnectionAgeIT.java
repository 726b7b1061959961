package dev.sidecar.it;

import static dev.sidecar.it.StaticResolver.local;
import static org.assertj.core.api.Assertions.assertThat;

import dev.sidecar.client.SidecarClient;
import java.time.Duration;
import java.util.List;
import org.junit.jupiter.api.Test;

/**
 * The sidecar's max connection age makes clients re-resolve: grpc-java asks its resolver
 * again only when a connection closes, so without an age a replica added to a headless
 * Service is never used by a client whose connections stay healthy.
 */
class ConnectionAgeIT {

    private static final Duration WINDOW = Duration.ofSeconds(5);

    private static String[] replica(String name, String maxAgeSeconds) {
        return new String[] {"--num-kv-blocks", "64", "--served-model-name", name,
                "--max-connection-age", maxAgeSeconds, "--max-connection-age-grace", "1"};
    }

    /** Calls the service until a call is answered by {@code replica}, for at most {@link #WINDOW}. */
    private static boolean reachedWithinWindow(SidecarClient client, String replica) throws InterruptedException {
        long end = System.nanoTime() + WINDOW.toNanos();
        while (System.nanoTime() < end) {
            if (replica.equals(client.modelInfo().getModel())) {
                return true;
            }
            Thread.sleep(20);
        }
        return false;
    }

    @Test
    void withAOneSecondMaxConnectionAgeANewReplicaReceivesCallsWithinFiveSeconds() throws Exception {
        try (SidecarProcess a = SidecarProcess.start(replica("replica-a", "1"));
             StaticResolver resolver = new StaticResolver(List.of(local(a)));
             SidecarClient client = SidecarClient.builder().target(resolver.target())
                     .defaultDeadline(Duration.ofSeconds(10)).build()) {
            assertThat(client.modelInfo().getModel()).isEqualTo("replica-a");
            try (SidecarProcess b = SidecarProcess.start(replica("replica-b", "1"))) {
                // The scale-up: the name now resolves to both, but only a re-resolution shows it.
                resolver.setAddresses(List.of(local(a), local(b)));
                assertThat(reachedWithinWindow(client, "replica-b"))
                        .as("a call answered by the new replica within %s", WINDOW).isTrue();
            }
        }
    }

    @Test
    void withoutAMaxConnectionAgeTheNewReplicaGetsNoCalls() throws Exception {
        try (SidecarProcess a = SidecarProcess.start(replica("replica-a", "0"));
             StaticResolver resolver = new StaticResolver(List.of(local(a)));
             SidecarClient client = SidecarClient.builder().target(resolver.target())
                     .defaultDeadline(Duration.ofSeconds(10)).build()) {
            assertThat(client.modelInfo().getModel()).isEqualTo("replica-a");
            try (SidecarProcess b = SidecarProcess.start(replica("replica-b", "0"))) {
                resolver.setAddresses(List.of(local(a), local(b)));
                int before = resolver.resolutions.get();
                assertThat(reachedWithinWindow(client, "replica-b")).as("the new replica is not seen").isFalse();
                assertThat(resolver.resolutions.get()).as("no re-resolution").isEqualTo(before);
            }
        }
    }
}
