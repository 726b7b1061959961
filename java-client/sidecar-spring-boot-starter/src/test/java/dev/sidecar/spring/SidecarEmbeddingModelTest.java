package dev.sidecar.spring;

import static org.assertj.core.api.Assertions.assertThat;

import dev.sidecar.client.SidecarClient;
import java.util.List;
import java.util.stream.IntStream;
import org.junit.jupiter.api.AfterEach;
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
    void dimensionsComeFromModelInfoOnce() {
        assertThat(model.dimensions()).isEqualTo(3);
        assertThat(model.dimensions()).isEqualTo(3);
        assertThat(sidecar.modelInfoCalls.get()).isEqualTo(1);
        assertThat(sidecar.embeds).isEmpty();
    }
}
