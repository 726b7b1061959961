package dev.sidecar.client;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import dev.sidecar.v1.ChatRequest;
import io.grpc.Metadata;
import io.grpc.Status;
import java.time.Duration;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.stream.Stream;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.params.ParameterizedTest;
import org.junit.jupiter.params.provider.Arguments;
import org.junit.jupiter.params.provider.MethodSource;
import reactor.test.StepVerifier;

class ErrorMappingTest {

    private InProcessSidecar sidecar;
    private SidecarClient client;

    @BeforeEach
    void setUp() throws Exception {
        sidecar = new InProcessSidecar();
        // Retries off: UNAVAILABLE must surface on the first failure here.
        client = sidecar.clientBuilder().maxRetryAttempts(1).build();
    }

    @AfterEach
    void tearDown() throws Exception {
        client.close();
        sidecar.close();
    }

    private void failNext(Status status, Metadata trailers) {
        sidecar.service.failNext.add(new FakeInference.Failure(status, trailers));
    }

    static Stream<Arguments> statuses() {
        return Stream.of(
                Arguments.of(Status.INVALID_ARGUMENT, InvalidRequestException.class),
                Arguments.of(Status.UNAUTHENTICATED, UnauthenticatedException.class),
                Arguments.of(Status.PERMISSION_DENIED, PermissionDeniedException.class),
                Arguments.of(Status.RESOURCE_EXHAUSTED, RateLimitedException.class),
                Arguments.of(Status.UNAVAILABLE, SidecarUnavailableException.class),
                Arguments.of(Status.DEADLINE_EXCEEDED, DeadlineExceededException.class),
                Arguments.of(Status.NOT_FOUND, ModelNotFoundException.class),
                Arguments.of(Status.INTERNAL, SidecarException.class));
    }

    @ParameterizedTest
    @MethodSource("statuses")
    void blockingCallsThrowTheTypedException(Status status, Class<? extends SidecarException> type) {
        failNext(status.withDescription("sampling.temperature: must be >= 0, got -1"), new Metadata());

        assertThatThrownBy(() -> client.chat(chat()))
                .isExactlyInstanceOf(type)
                .hasMessageContaining("sampling.temperature")
                .extracting(e -> ((SidecarException) e).getCode()).isEqualTo(status.getCode());
    }

    @ParameterizedTest
    @MethodSource("statuses")
    void futuresCompleteWithTheTypedException(Status status, Class<? extends SidecarException> type) {
        failNext(status, new Metadata());

        assertThatThrownBy(() -> client.chatAsync(chat()).get(5, TimeUnit.SECONDS))
                .isInstanceOf(ExecutionException.class)
                .cause().isExactlyInstanceOf(type);
    }

    @ParameterizedTest
    @MethodSource("statuses")
    void streamsSignalTheTypedException(Status status, Class<? extends SidecarException> type) {
        failNext(status, new Metadata());

        StepVerifier.create(client.chatStream(chat()))
                .expectErrorSatisfies(e -> assertThat(e).isExactlyInstanceOf(type))
                .verify(Duration.ofSeconds(5));
    }

    @Test
    void rateLimitCarriesRetryAfterFromTrailers() {
        Metadata trailers = new Metadata();
        trailers.put(SidecarErrors.RETRY_AFTER_MS, "1500");
        failNext(Status.RESOURCE_EXHAUSTED.withDescription("rate limit exceeded"), trailers);

        assertThatThrownBy(() -> client.generate("x"))
                .isInstanceOfSatisfying(RateLimitedException.class,
                        e -> assertThat(e.getRetryAfter()).contains(Duration.ofMillis(1500)));
    }

    @Test
    void malformedOrMissingRetryAfterGivesNoHint() {
        Metadata bad = new Metadata();
        bad.put(SidecarErrors.RETRY_AFTER_MS, "soon");
        assertThat(SidecarErrors.retryAfter(bad)).isNull();
        assertThat(SidecarErrors.retryAfter(new Metadata())).isNull();
        Metadata fractional = new Metadata();
        fractional.put(SidecarErrors.RETRY_AFTER_MS, "0.5");
        assertThat(SidecarErrors.retryAfter(fractional)).isEqualTo(Duration.ofNanos(500_000));
    }

    @Test
    void messageSizeLimitsAreNotRateLimits() {
        // ours, on a response
        assertThat(SidecarErrors.from(Status.RESOURCE_EXHAUSTED
                .withDescription("gRPC message exceeds maximum size 10: 20").asRuntimeException()))
                .isExactlyInstanceOf(MessageTooLargeException.class);
        // the sidecar's (gRPC core's wording), on a request over --max-message-bytes
        failNext(Status.RESOURCE_EXHAUSTED.withDescription("Received message larger than max (5000000 vs. 4194304)"),
                new Metadata());
        assertThatThrownBy(() -> client.chat(chat())).isExactlyInstanceOf(MessageTooLargeException.class)
                .isNotInstanceOf(RateLimitedException.class);
    }

    @Test
    void notFoundIsACacheMissOnlyForTheCacheAndOtherwiseAnUnknownModel() {
        failNext(Status.NOT_FOUND.withDescription("semantic cache miss"), new Metadata());
        assertThatThrownBy(() -> client.chat(chat())).isExactlyInstanceOf(CacheMissException.class);

        failNext(Status.NOT_FOUND.withDescription("model: unknown model 'gpt-4'; this sidecar serves 'demo'"),
                new Metadata());
        assertThatThrownBy(() -> client.chat(chat())).isExactlyInstanceOf(ModelNotFoundException.class)
                .isInstanceOf(InvalidRequestException.class).hasMessageContaining("model: unknown model");
    }

    private static ChatRequest chat() {
        return ChatRequest.newBuilder().addMessages(SidecarClient.user("q")).build();
    }
}
