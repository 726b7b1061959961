package dev.sidecar.it;

import static dev.sidecar.it.StaticResolver.local;
import static org.assertj.core.api.Assertions.assertThat;

import dev.sidecar.client.SidecarClient;
import dev.sidecar.spring.SidecarHealthIndicator;
import dev.sidecar.v1.ChatRequest;
import dev.sidecar.v1.Completion;
import dev.sidecar.v1.SamplingParams;
import java.time.Duration;
import java.util.HashSet;
import java.util.List;
import java.util.Set;
import org.junit.jupiter.api.Test;
import org.springframework.boot.health.contributor.Status;
import reactor.core.Disposable;

/** Round-robin over two real sidecars, one of which drains (SIGTERM with a request still running). */
class ReplicasIT {

    private static String[] replica(String name) {
        return new String[] {"--num-kv-blocks", "512", "--served-model-name", name, "--shutdown-timeout", "30"};
    }

    private static ChatRequest chat(String text, int maxTokens) {
        return ChatRequest.newBuilder().addMessages(SidecarClient.user(text))
                .setSampling(SamplingParams.newBuilder().setMaxTokens(maxTokens).setTemperature(0).setIgnoreEos(true))
                .build();
    }

    @Test
    void callsSpreadOverBothAndADrainingReplicaGetsNoneWhileItsHealthIsOutOfService() throws Exception {
        try (SidecarProcess a = SidecarProcess.start(replica("replica-a"));
             SidecarProcess b = SidecarProcess.start(replica("replica-b"));
             StaticResolver resolver = new StaticResolver(List.of(local(a), local(b)));
             SidecarClient client = SidecarClient.builder().target(resolver.target()).healthCheck(true)
                     .defaultDeadline(Duration.ofSeconds(30)).build();
             SidecarClient direct = b.client()) {
            Set<String> served = new HashSet<>();
            for (int i = 0; i < 200 && served.size() < 2; i++) {
                served.add(client.chat(chat("hi", 1)).getModel());
            }
            assertThat(served).containsExactlyInAnyOrder("replica-a", "replica-b");

            SidecarHealthIndicator bHealth = new SidecarHealthIndicator(direct, Duration.ofSeconds(2));
            assertThat(bHealth.health().getStatus()).isEqualTo(Status.UP);

            // A long generation keeps B draining (~2 ms a token on the demo model) after SIGTERM.
            Disposable running = direct.chatStream(chat("Tell a long story.", 4000)).subscribe(c -> { }, e -> { });
            try {
                long end = System.nanoTime() + Duration.ofSeconds(30).toNanos();
                while (direct.stats().getNumRunning() == 0 && System.nanoTime() < end) {
                    Thread.sleep(20);
                }
                b.beginDrain();
                while (!Status.OUT_OF_SERVICE.equals(bHealth.health().getStatus()) && System.nanoTime() < end) {
                    Thread.sleep(20);
                }
                assertThat(bHealth.health().getStatus()).as("B's health while draining").isEqualTo(Status.OUT_OF_SERVICE);
                assertThat(b.isAlive()).as("B is still draining").isTrue();

                // The client's health watch of B has seen NOT_SERVING once calls stop reaching it.
                int onA = 0;
                for (int i = 0; i < 200 && onA < 5; i++) {
                    onA = "replica-a".equals(client.chat(chat("again", 1)).getModel()) ? onA + 1 : 0;
                }
                for (int i = 0; i < 20; i++) {
                    Completion c = client.chat(chat("while B drains " + i, 2));
                    assertThat(c.getModel()).isEqualTo("replica-a");
                    assertThat(c.getUsage().getCompletionTokens()).isEqualTo(2);
                }
                assertThat(b.isAlive()).as("B was draining throughout").isTrue();
            } finally {
                running.dispose();
            }
        }
    }
}
