package dev.sidecar.client;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import dev.sidecar.v1.ChatRequest;
import dev.sidecar.v1.Completion;
import dev.sidecar.v1.CompletionChunk;
import dev.sidecar.v1.EmbedResponse;
import dev.sidecar.v1.FinishReason;
import dev.sidecar.v1.GenerateRequest;
import dev.sidecar.v1.SamplingParams;
import dev.sidecar.v1.TokenizeResponse;
import io.grpc.ManagedChannel;
import io.grpc.Metadata;
import io.grpc.inprocess.InProcessChannelBuilder;
import java.time.Duration;
import java.util.List;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;

class SidecarClientTest {

    private InProcessSidecar sidecar;
    private SidecarClient client;

    @BeforeEach
    void setUp() throws Exception {
        sidecar = new InProcessSidecar();
        client = sidecar.clientBuilder().apiKey("secret-key").build();
    }

    @AfterEach
    void tearDown() throws Exception {
        client.close();
        sidecar.close();
    }

    private static ChatRequest chatRequest(String text) {
        return ChatRequest.newBuilder()
                .addMessages(SidecarClient.system("be brief"))
                .addMessages(SidecarClient.user(text))
                .setSampling(SamplingParams.newBuilder().setMaxTokens(8).setSeed(42))
                .build();
    }

    @Test
    void chatSendsTheRequestAndReturnsTheCompletion() {
        Completion c = client.chat(chatRequest("hello"));

        assertThat(c.getText()).isEqualTo("echo: hello");
        assertThat(c.getUsage().getCachedTokens()).isEqualTo(4);
        ChatRequest seen = (ChatRequest) sidecar.service.lastRequest;
        assertThat(seen.getMessagesList()).extracting("role").containsExactly("system", "user");
        assertThat(seen.getSampling().getSeed()).isEqualTo(42);
    }

    @Test
    void apiKeyIsSentAsBearerMetadata() {
        client.modelInfo();

        Metadata h = sidecar.service.headers.peek();
        assertThat(h.get(BearerAuthInterceptor.AUTHORIZATION)).isEqualTo("Bearer secret-key");
    }

    @Test
    void noAuthorizationHeaderWithoutApiKey() throws Exception {
        try (SidecarClient anonymous = sidecar.clientBuilder().build()) {
            anonymous.stats();
        }
        assertThat(sidecar.service.headers.peek().get(BearerAuthInterceptor.AUTHORIZATION)).isNull();
    }

    @Test
    void generateBlockingAndAsync() throws Exception {
        assertThat(client.generate("abc").getText()).isEqualTo("echo: abc");
        Completion async = client.generateAsync(GenerateRequest.newBuilder().setPrompt("def").build())
                .get(5, TimeUnit.SECONDS);
        assertThat(async.getText()).isEqualTo("echo: def");
        assertThat(client.chatAsync(chatRequest("ghi")).get(5, TimeUnit.SECONDS).getText()).isEqualTo("echo: ghi");
    }

    @Test
    void streamsDeliverEveryChunkInOrder() {
        List<CompletionChunk> chunks = client.chatStream(chatRequest("s")).collectList().block(Duration.ofSeconds(5));
        assertThat(chunks).extracting(CompletionChunk::getDelta).containsExactly("t0", "t1", "t2", "t3", "t4");
        assertThat(chunks.get(4).getFinishReason()).isEqualTo(FinishReason.FINISH_REASON_LENGTH);

        List<CompletionChunk> gen = client.generateStream(GenerateRequest.newBuilder().setPrompt("p").build())
                .collectList().block(Duration.ofSeconds(5));
        assertThat(gen).hasSize(5);
        assertThat(((GenerateRequest) sidecar.service.lastRequest).getPrompt()).isEqualTo("p");
    }

    @Test
    void streamIsColdUntilSubscribed() {
        var flux = client.chatStream(chatRequest("later"));
        assertThat(sidecar.service.calls.get()).isZero();
        flux.blockLast(Duration.ofSeconds(5));
        assertThat(sidecar.service.calls.get()).isEqualTo(1);
    }

    @Test
    void embedTokenizeModelInfoStats() {
        EmbedResponse e = client.embed(List.of("a", "bcd"));
        assertThat(e.getEmbeddingsList()).hasSize(2);
        assertThat(e.getEmbeddings(1).getValues(0)).isEqualTo(3f);

        TokenizeResponse t = client.tokenize("hi");
        assertThat(t.getCount()).isEqualTo(2);
        assertThat(t.getTokensList()).containsExactly("h", "i");

        assertThat(client.modelInfo().getModel()).isEqualTo("demo");
        assertThat(client.stats().getNumFreeKvBlocks()).isEqualTo(60);
    }

    @Test
    void closeShutsDownAnOwnedChannelButNotAnInjectedOne() throws Exception {
        ManagedChannel injected = InProcessChannelBuilder.forName(sidecar.name).build();
        try {
            SidecarClient borrowed = SidecarClient.builder().channel(injected).build();
            assertThat(borrowed.stats().getNumKvBlocks()).isEqualTo(64);
            borrowed.close();
            assertThat(injected.isShutdown()).isFalse();
        } finally {
            injected.shutdownNow();
        }

        client.close();
        assertThatThrownBy(() -> client.stats()).isInstanceOf(SidecarUnavailableException.class);
    }

    @Test
    void builderRejectsBadSettingsNamingTheField() {
        assertThatThrownBy(() -> SidecarClient.builder().target(" "))
                .isInstanceOf(IllegalArgumentException.class).hasMessageContaining("target");
        assertThatThrownBy(() -> SidecarClient.builder().defaultDeadline(Duration.ZERO))
                .hasMessageContaining("defaultDeadline");
        assertThatThrownBy(() -> SidecarClient.builder().maxRetryAttempts(0))
                .hasMessageContaining("maxRetryAttempts");
        assertThatThrownBy(() -> SidecarClient.builder().maxInboundMessageSize(0))
                .hasMessageContaining("maxInboundMessageSize");
    }
}
