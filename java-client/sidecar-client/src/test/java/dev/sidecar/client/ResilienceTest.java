package dev.sidecar.client;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import io.grpc.Metadata;
import io.grpc.Status;
import java.time.Duration;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;

class ResilienceTest {

    private InProcessSidecar sidecar;

    @BeforeEach
    void setUp() throws Exception {
        sidecar = new InProcessSidecar();
    }

    @AfterEach
    void tearDown() throws Exception {
        sidecar.close();
    }

    private void failNext(Status status) {
        sidecar.service.failNext.add(new FakeInference.Failure(status, new Metadata()));
    }

    @Test
    void unavailableIsRetriedByTheServiceConfig() {
        failNext(Status.UNAVAILABLE.withDescription("loading"));
        try (SidecarClient client = sidecar.clientBuilder()
                .retryBackoff(Duration.ofMillis(10), Duration.ofMillis(50)).build()) {
            assertThat(client.generate("again").getText()).isEqualTo("echo: again");
        }
        assertThat(sidecar.service.calls.get()).isEqualTo(2);
    }

    @Test
    void retriesStopAfterMaxAttempts() {
        for (int i = 0; i < 5; i++) {
            failNext(Status.UNAVAILABLE.withDescription("draining"));
        }
        try (SidecarClient client = sidecar.clientBuilder().maxRetryAttempts(3)
                .retryBackoff(Duration.ofMillis(10), Duration.ofMillis(50)).build()) {
            assertThatThrownBy(() -> client.stats()).isInstanceOf(SidecarUnavailableException.class)
                    .hasMessageContaining("draining");
        }
        assertThat(sidecar.service.calls.get()).isEqualTo(3);
    }

    @Test
    void otherStatusesAreNotRetried() {
        failNext(Status.INVALID_ARGUMENT.withDescription("prompt: must not be empty"));
        try (SidecarClient client = sidecar.clientBuilder().build()) {
            assertThatThrownBy(() -> client.generate("")).isInstanceOf(InvalidRequestException.class);
        }
        assertThat(sidecar.service.calls.get()).isEqualTo(1);
    }

    @Test
    void defaultDeadlineCancelsTheServerSideCall() throws Exception {
        sidecar.service.hang = true;
        try (SidecarClient client = sidecar.clientBuilder().defaultDeadline(Duration.ofMillis(200)).build()) {
            assertThatThrownBy(() -> client.generate("slow")).isInstanceOf(DeadlineExceededException.class);
            // The server learns about the expired deadline as a cancellation.
            assertThat(sidecar.service.cancelled.await(5, TimeUnit.SECONDS)).isTrue();
        }
    }

    @Test
    void cancellingAFutureCancelsTheCall() throws Exception {
        sidecar.service.hang = true;
        try (SidecarClient client = sidecar.clientBuilder().build()) {
            var future = client.generateAsync(dev.sidecar.v1.GenerateRequest.newBuilder().setPrompt("x").build());
            // Wait until the call reached the server, so the cancel travels over the wire.
            long end = System.nanoTime() + 5_000_000_000L;
            while (sidecar.service.calls.get() == 0 && System.nanoTime() < end) {
                Thread.sleep(5);
            }
            assertThat(sidecar.service.calls.get()).isEqualTo(1);
            future.cancel(true);
            assertThat(sidecar.service.cancelled.await(5, TimeUnit.SECONDS)).isTrue();
        }
    }
}
