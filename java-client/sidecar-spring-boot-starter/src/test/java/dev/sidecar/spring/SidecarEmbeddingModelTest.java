package dev.sidecar.spring;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import dev.sidecar.client.SidecarClient;
import java.util.List;
import java.util.stream.IntStream;
import dev.sidecar.client.SidecarUnavailableException;
import io.micrometer.observation.tck.TestObservationRegistry;
import io.micrometer.observation.tck.TestObservationRegistryAssert;
import org.junit.jupiter.api.AfterEach;
import org.springframework.ai.retry.TransientAiException;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import org.springframework.ai.document.Document;
import org.springframework.ai.embedding.EmbeddingResponse;

class SidecarEmbeddingModelTest {

    private FakeSidecar sidecar;
    private SidecarClient client;
    private SidecarEmbeddingModel model;

    @BeforeEach
    void setUp() throws Exception {
        sidecar = new FakeSidecar();
        client = SidecarClient.builder().channelBuilder(sidecar.channelBuilder()).build();
        model = new SidecarEmbeddingModel(client);
    }

    @AfterEach
    void tearDown() throws Exception {
        client.close();
        sidecar.close();
    }

    @Test
    void embedsInOrderWithUsageAndModel() {
        EmbeddingResponse r = model.embedForResponse(List.of("a", "abcd"));

        assertThat(r.getResults()).hasSize(2);
        assertThat(r.getResults().get(1).getOutput()).containsExactly(4f, 1f, 0f);
        assertThat(r.getResults().get(1).getIndex()).isEqualTo(1);
        assertThat(r.getMetadata().getModel()).isEqualTo("mini-embed");
        assertThat(r.getMetadata().getUsage().getPromptTokens()).isEqualTo(4);
        assertThat(model.embed(new Document("xyz"))).containsExactly(3f, 1f, 0f);
    }

    @Test
    void largeRequestsAreSplitAtTheRpcLimitKeepingIndices() {
        List<String> texts = IntStream.range(0, 300).mapToObj(i -> "t".repeat(i % 7 + 1)).toList();

        EmbeddingResponse r = model.embedForResponse(texts);

        assertThat(sidecar.embeds).extracting(e -> e.getInputsCount()).containsExactly(256, 44);
        assertThat(r.getResults()).hasSize(300);
        assertThat(r.getResults().get(299).getIndex()).isEqualTo(299);
        assertThat(r.getResults().get(299).getOutput()[0]).isEqualTo(299 % 7 + 1);
    }

    @Test
    void callsAreObservedOncePerRequestWithUsage() {
        TestObservationRegistry observations = TestObservationRegistry.create();
        SidecarEmbeddingModel observed = new SidecarEmbeddingModel(client, observations);
        List<String> texts = IntStream.range(0, 300).mapToObj(i -> "t").toList();

        observed.embedForResponse(texts);

        TestObservationRegistryAssert.assertThat(observations).hasNumberOfObservationsEqualTo(1)
                .hasObservationWithNameEqualTo("gen_ai.client.operation").that()
                .hasLowCardinalityKeyValue("gen_ai.operation.name", "embedding")
                .hasLowCardinalityKeyValue("gen_ai.system", "sidecar")
                .hasHighCardinalityKeyValue("gen_ai.usage.input_tokens", "600");
    }

    @Test
    void failuresAreSpringAiExceptionsAndObserved() throws Exception {
        TestObservationRegistry observations = TestObservationRegistry.create();
        sidecar.close();
        try (SidecarClient gone = SidecarClient.builder().channelBuilder(sidecar.channelBuilder())
                .maxRetryAttempts(1).build()) {
            SidecarEmbeddingModel m = new SidecarEmbeddingModel(gone, observations);
            assertThatThrownBy(() -> m.embed("x")).isInstanceOf(TransientAiException.class)
                    .hasCauseInstanceOf(SidecarUnavailableException.class);
        }
        TestObservationRegistryAssert.assertThat(observations).hasObservationWithNameEqualTo("gen_ai.client.operation")
                .that().hasError();
    }

    @Test
    void dimensionsComeFromModelInfoOnce() {
        assertThat(model.dimensions()).isEqualTo(3);
        assertThat(model.dimensions()).isEqualTo(3);
        assertThat(sidecar.modelInfoCalls.get()).isEqualTo(1);
        assertThat(sidecar.embeds).isEmpty();
    }
}
