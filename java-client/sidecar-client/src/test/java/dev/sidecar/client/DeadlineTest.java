package dev.sidecar.client;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import dev.sidecar.v1.ChatRequest;
import dev.sidecar.v1.EmbedRequest;
import java.time.Duration;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;

/** Per-call deadlines and the separate stream default, as the server receives them. */
class DeadlineTest {

    private InProcessSidecar sidecar;
    private SidecarClient client;

    @BeforeEach
    void setUp() throws Exception {
        sidecar = new InProcessSidecar();
        client = sidecar.clientBuilder().maxRetryAttempts(1)
                .defaultDeadline(Duration.ofSeconds(30)).defaultStreamDeadline(Duration.ofMinutes(10)).build();
    }

    @AfterEach
    void tearDown() throws Exception {
        client.close();
        sidecar.close();
    }

    private static ChatRequest chat() {
        return ChatRequest.newBuilder().addMessages(SidecarClient.user("q")).build();
    }

    private long remainingSeconds() {
        return sidecar.service.lastDeadline.timeRemaining(TimeUnit.SECONDS);
    }

    @Test
    void unaryCallsUseTheDefaultUnlessGivenTheirOwn() throws Exception {
        client.chat(chat());
        assertThat(remainingSeconds()).isBetween(1L, 30L);

        client.chat(chat(), Duration.ofSeconds(300));
        assertThat(remainingSeconds()).isBetween(31L, 300L);

        client.chatAsync(chat(), Duration.ofSeconds(200)).get(5, TimeUnit.SECONDS);
        assertThat(remainingSeconds()).isBetween(31L, 200L);

        client.embed(EmbedRequest.newBuilder().addInputs("a").build(), Duration.ofSeconds(100));
        assertThat(remainingSeconds()).isBetween(31L, 100L);
    }

    @Test
    void streamsUseTheStreamDefaultUnlessGivenTheirOwn() {
        client.chatStream(chat()).blockLast(Duration.ofSeconds(5));
        assertThat(remainingSeconds()).isBetween(301L, 600L);

        client.chatStream(chat(), Duration.ofSeconds(45)).blockLast(Duration.ofSeconds(5));
        assertThat(remainingSeconds()).isBetween(31L, 45L);
    }

    @Test
    void streamDefaultFallsBackToTheUnaryDefault() throws Exception {
        try (SidecarClient plain = sidecar.clientBuilder().defaultDeadline(Duration.ofSeconds(20)).build()) {
            assertThat(plain.defaultStreamDeadline()).isEqualTo(Duration.ofSeconds(20));
            plain.chatStream(chat()).blockLast(Duration.ofSeconds(5));
            assertThat(remainingSeconds()).isBetween(1L, 20L);
        }
    }

    @Test
    void aNullStreamDefaultMeansStreamsHaveNoDeadline() throws Exception {
        try (SidecarClient c = sidecar.clientBuilder().defaultDeadline(Duration.ofSeconds(20))
                .defaultStreamDeadline(null).build()) {
            c.chatStream(chat()).blockLast(Duration.ofSeconds(5));
            assertThat(sidecar.service.lastDeadline).isNull();
        }
    }

    @Test
    void aShortPerCallDeadlineEndsAHangingCall() throws Exception {
        sidecar.service.hang = true;
        assertThatThrownBy(() -> client.chat(chat(), Duration.ofMillis(200)))
                .isInstanceOf(DeadlineExceededException.class);
        assertThat(sidecar.service.cancelled.await(5, TimeUnit.SECONDS)).as("server saw the cancel").isTrue();
    }

    @Test
    void nonPositiveDeadlinesAreRejectedNamingTheArgument() {
        assertThatThrownBy(() -> client.chat(chat(), Duration.ZERO)).isInstanceOf(IllegalArgumentException.class)
                .hasMessageContaining("deadline");
        assertThatThrownBy(() -> SidecarClient.builder().defaultStreamDeadline(Duration.ofSeconds(-1)))
                .hasMessageContaining("defaultStreamDeadline");
    }
}
