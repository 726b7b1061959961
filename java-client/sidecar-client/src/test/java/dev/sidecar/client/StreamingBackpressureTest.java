package dev.sidecar.client;

import static org.assertj.core.api.Assertions.assertThat;

import dev.sidecar.v1.ChatRequest;
import dev.sidecar.v1.CompletionChunk;
import java.time.Duration;
import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import reactor.core.publisher.BaseSubscriber;

class StreamingBackpressureTest {

    private InProcessSidecar sidecar;
    private SidecarClient client;

    @BeforeEach
    void setUp() throws Exception {
        sidecar = new InProcessSidecar();
        sidecar.service.streamChunks = 100;
        client = sidecar.clientBuilder().build();
    }

    @AfterEach
    void tearDown() throws Exception {
        client.close();
        sidecar.close();
    }

    private static ChatRequest chat() {
        return ChatRequest.newBuilder().addMessages(SidecarClient.user("long answer")).build();
    }

    /** Requests nothing on subscribe; the test drives demand explicitly. */
    private static final class ManualSubscriber extends BaseSubscriber<CompletionChunk> {
        final List<CompletionChunk> received = new CopyOnWriteArrayList<>();

        @Override
        protected void hookOnSubscribe(org.reactivestreams.Subscription s) {
        }

        @Override
        protected void hookOnNext(CompletionChunk value) {
            received.add(value);
        }
    }

    private static void awaitSize(List<?> list, int size) throws InterruptedException {
        long end = System.nanoTime() + TimeUnit.SECONDS.toNanos(5);
        while (list.size() < size && System.nanoTime() < end) {
            Thread.sleep(5);
        }
        assertThat(list).hasSize(size);
    }

    @Test
    void serverSendsOnlyWhatTheSubscriberRequested() throws Exception {
        ManualSubscriber sub = new ManualSubscriber();
        client.chatStream(chat()).subscribe(sub);

        sub.request(3);
        awaitSize(sub.received, 3);
        // Give an unbounded producer the chance to overrun; a correct bridge keeps it at 3.
        Thread.sleep(200);
        assertThat(sidecar.service.chunksSent.get()).isEqualTo(3);
        assertThat(sub.received).hasSize(3);

        sub.request(2);
        awaitSize(sub.received, 5);
        Thread.sleep(100);
        assertThat(sidecar.service.chunksSent.get()).isEqualTo(5);

        sub.cancel();
        assertThat(sidecar.service.cancelled.await(5, TimeUnit.SECONDS)).isTrue();
        assertThat(sidecar.service.chunksSent.get()).isLessThan(100);
    }

    @Test
    void cancellingTheSubscriptionCancelsTheCall() throws Exception {
        List<CompletionChunk> firstTwo = client.chatStream(chat()).take(2).collectList()
                .block(Duration.ofSeconds(5));

        assertThat(firstTwo).extracting(CompletionChunk::getDelta).containsExactly("t0", "t1");
        assertThat(sidecar.service.cancelled.await(5, TimeUnit.SECONDS)).isTrue();
        assertThat(sidecar.service.chunksSent.get()).isLessThan(100);
    }

    @Test
    void unboundedDemandReceivesTheWholeStream() {
        List<CompletionChunk> all = client.chatStream(chat()).collectList().block(Duration.ofSeconds(10));
        assertThat(all).hasSize(100);
        assertThat(all.get(99).getUsage().getCompletionTokens()).isEqualTo(100);
    }
}
