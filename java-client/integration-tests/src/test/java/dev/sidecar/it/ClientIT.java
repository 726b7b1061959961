package dev.sidecar.it;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import dev.sidecar.client.DeadlineExceededException;
import dev.sidecar.client.InvalidRequestException;
import dev.sidecar.client.SidecarClient;
import dev.sidecar.v1.ChatRequest;
import dev.sidecar.v1.Completion;
import dev.sidecar.v1.CompletionChunk;
import dev.sidecar.v1.EngineStats;
import dev.sidecar.v1.FinishReason;
import dev.sidecar.v1.SamplingParams;
import java.time.Duration;
import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.stream.Collectors;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.extension.RegisterExtension;
import org.reactivestreams.Subscription;
import reactor.core.publisher.BaseSubscriber;

/** SidecarClient against the real Python sidecar. */
class ClientIT {

    @RegisterExtension
    static final RealSidecar SIDECAR = RealSidecar.with(ItArgs.DEFAULT);

    private static SidecarClient client;

    @BeforeAll
    static void open() {
        client = SIDECAR.process().client();
    }

    @AfterAll
    static void close() {
        if (client != null) {
            client.close();
        }
    }

    private static ChatRequest chat(String text, int maxTokens, boolean ignoreEos) {
        return ChatRequest.newBuilder()
                .addMessages(SidecarClient.system("You are a test."))
                .addMessages(SidecarClient.user(text))
                .setSampling(SamplingParams.newBuilder().setMaxTokens(maxTokens).setTemperature(0)
                        .setIgnoreEos(ignoreEos))
                .build();
    }

    @Test
    void blockingAsyncAndStreamingAgreeUnderGreedyDecoding() throws Exception {
        ChatRequest request = chat("Say something.", 8, true);

        Completion blocking = client.chat(request);
        Completion async = client.chatAsync(request).get();
        List<CompletionChunk> chunks = client.chatStream(request).collectList().block(Duration.ofSeconds(60));

        assertThat(blocking.getUsage().getCompletionTokens()).isEqualTo(8);
        assertThat(blocking.getUsage().getPromptTokens()).isPositive();
        assertThat(blocking.getFinishReason()).isEqualTo(FinishReason.FINISH_REASON_LENGTH);
        assertThat(async.getTokenIdsList()).isEqualTo(blocking.getTokenIdsList());
        String streamed = chunks.stream().map(CompletionChunk::getDelta).collect(Collectors.joining());
        assertThat(streamed).isEqualTo(blocking.getText());
        CompletionChunk last = chunks.get(chunks.size() - 1);
        assertThat(last.getFinishReason()).isEqualTo(FinishReason.FINISH_REASON_LENGTH);
        assertThat(last.getUsage().getCompletionTokens()).isEqualTo(8);
    }

    @Test
    void modelInfoTokenizeAndStats() {
        assertThat(client.modelInfo().getModel()).isEqualTo("demo");
        var tokens = client.tokenize("hello world");
        assertThat(tokens.getCount()).isPositive().isEqualTo(tokens.getTokenIdsCount());
        EngineStats stats = client.stats();
        assertThat(stats.getNumKvBlocks()).isPositive().isEqualTo(client.modelInfo().getNumKvBlocks());
        assertThat(stats.getNumFreeKvBlocks()).isLessThanOrEqualTo(stats.getNumKvBlocks());
    }

    @Test
    void invalidSamplingIsRejectedNamingTheField() {
        ChatRequest bad = chat("x", 4, false).toBuilder()
                .setSampling(SamplingParams.newBuilder().setTemperature(-1)).build();
        assertThatThrownBy(() -> client.chat(bad)).isInstanceOf(InvalidRequestException.class)
                .hasMessageContaining("temperature");
    }

    /** Requests nothing until told to; records what arrives. */
    private static final class Manual extends BaseSubscriber<CompletionChunk> {
        final List<CompletionChunk> got = new CopyOnWriteArrayList<>();

        @Override
        protected void hookOnSubscribe(Subscription s) {
            s.request(1);
        }

        @Override
        protected void hookOnNext(CompletionChunk c) {
            got.add(c);
        }
    }

    @Test
    void cancellingAStreamMidwayFreesTheSidecarsBlocks() throws Exception {
        // A long generation (EOS ignored) that is certainly still running when cancelled.
        Manual sub = new Manual();
        client.chatStream(chat("Tell a long story.", 2000, true)).subscribe(sub);
        long end = System.nanoTime() + 60_000_000_000L;
        while (sub.got.isEmpty() && System.nanoTime() < end) {
            Thread.sleep(20);
        }
        assertThat(sub.got).isNotEmpty();
        EngineStats running = client.stats();
        assertThat(running.getNumFreeKvBlocks()).as("the streaming request holds KV blocks")
                .isLessThan(running.getNumKvBlocks());

        sub.cancel();

        Blocks.awaitAllFree(client, 30_000);
        assertThat(sub.isDisposed()).isTrue();
    }

    @Test
    void deadlineAbortsTheRequestAndFreesItsBlocks() throws Exception {
        try (SidecarClient hurried = SidecarClient.builder().target(SIDECAR.process().grpcTarget())
                .defaultDeadline(Duration.ofMillis(500)).build()) {
            assertThatThrownBy(() -> hurried.chat(chat("Tell a long story.", 2000, true)))
                    .isInstanceOf(DeadlineExceededException.class);
        }
        Blocks.awaitAllFree(client, 30_000);
    }
}
