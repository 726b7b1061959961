package dev.sidecar.it;

import static org.assertj.core.api.Assertions.assertThat;
import static org.springframework.test.web.servlet.request.MockMvcRequestBuilders.post;
import static org.springframework.test.web.servlet.result.MockMvcResultMatchers.jsonPath;
import static org.springframework.test.web.servlet.result.MockMvcResultMatchers.status;

import dev.sidecar.client.SidecarClient;
import dev.sidecar.demo.ChatDemoApplication;
import dev.sidecar.spring.SidecarChatModel;
import dev.sidecar.spring.SidecarChatOptions;
import java.util.List;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.extension.RegisterExtension;
import org.springframework.ai.chat.model.ChatResponse;
import org.springframework.ai.chat.prompt.Prompt;
import org.springframework.ai.embedding.EmbeddingModel;
import org.springframework.beans.factory.annotation.Autowired;
import org.springframework.boot.test.context.SpringBootTest;
import org.springframework.boot.webmvc.test.autoconfigure.AutoConfigureMockMvc;
import org.springframework.http.MediaType;
import org.springframework.test.context.DynamicPropertyRegistry;
import org.springframework.test.context.DynamicPropertySource;
import org.springframework.test.web.servlet.MockMvc;

/** The sidecar's semantic cache and Embed (real embedder) through the starter and the demo app. */
@SpringBootTest(classes = ChatDemoApplication.class, properties = {"sidecar.client.chat.max-tokens=4",
        "sidecar.client.chat.temperature=0", "chat-demo.system-prompt=You answer integration tests."})
@AutoConfigureMockMvc
class SemanticCacheIT {

    @RegisterExtension
    static final RealSidecar SIDECAR = RealSidecar.withSemanticCache("--num-kv-blocks", "128");

    @DynamicPropertySource
    static void sidecarTarget(DynamicPropertyRegistry registry) {
        registry.add("sidecar.client.target", () -> SIDECAR.process().grpcTarget());
    }

    @Autowired
    private SidecarChatModel chatModel;

    @Autowired
    private EmbeddingModel embeddingModel;

    @Autowired
    private MockMvc mvc;

    /** The sidecar stores an answer after replying (it embeds the question first): wait until it has. */
    private static void awaitEntries(long atLeast) throws InterruptedException {
        try (SidecarClient client = SIDECAR.process().client()) {
            long end = System.nanoTime() + 30_000_000_000L;
            while (client.stats().getSemanticCacheEntries() < atLeast && System.nanoTime() < end) {
                Thread.sleep(20);
            }
            assertThat(client.stats().getSemanticCacheEntries()).isGreaterThanOrEqualTo(atLeast);
        }
    }

    private static long entries() {
        try (SidecarClient client = SIDECAR.process().client()) {
            return client.stats().getSemanticCacheEntries();
        }
    }

    @Test
    void theSameGreedyQuestionTwiceIsAnExactHit() throws Exception {
        Prompt prompt = new Prompt("What colour is the sky on a clear day?",
                SidecarChatOptions.builder().temperature(0.0).maxTokens(4).build());
        long before = entries();
        ChatResponse first = chatModel.call(prompt);
        awaitEntries(before + 1);
        ChatResponse second = chatModel.call(prompt);

        assertThat((String) first.getMetadata().get(SidecarChatModel.CACHE_STATUS)).isEqualTo("MISS");
        assertThat((String) second.getMetadata().get(SidecarChatModel.CACHE_STATUS)).isEqualTo("HIT_EXACT");
        assertThat((Double) second.getMetadata().get(SidecarChatModel.CACHE_SIMILARITY)).isGreaterThan(0.999);
        assertThat(second.getResult().getOutput().getText()).isEqualTo(first.getResult().getOutput().getText());
    }

    @Test
    void theDemoRepliesCachedForARepeatedQuestion() throws Exception {
        String body = "{\"message\":\"Name three prime numbers.\"}";
        // Two new sessions: the same system prompt and question, so the same request.
        long before = entries();
        mvc.perform(post("/api/chat/message").header("X-Session-ID", "cache-1")
                        .contentType(MediaType.APPLICATION_JSON).content(body))
                .andExpect(status().isOk()).andExpect(jsonPath("$.cached").value(false));
        awaitEntries(before + 1);
        mvc.perform(post("/api/chat/message").header("X-Session-ID", "cache-2")
                        .contentType(MediaType.APPLICATION_JSON).content(body))
                .andExpect(status().isOk())
                .andExpect(jsonPath("$.cached").value(true))
                .andExpect(jsonPath("$.cacheStatus").value("HIT_EXACT"));
    }

    @Test
    void embeddingsAreUnitLengthWithTheServersDimensions() {
        int serverDimensions;
        try (SidecarClient client = SIDECAR.process().client()) {
            serverDimensions = client.modelInfo().getEmbeddingDimensions();
        }
        assertThat(serverDimensions).isPositive();
        assertThat(embeddingModel.dimensions()).isEqualTo(serverDimensions);

        List<float[]> vectors = embeddingModel.embed(List.of("a sidecar", "a motorcycle with a sidecar", "tea"));
        assertThat(vectors).hasSize(3);
        for (float[] v : vectors) {
            assertThat(v).hasSize(serverDimensions);
            double norm = 0;
            for (float x : v) {
                norm += x * x;
            }
            assertThat(Math.sqrt(norm)).isCloseTo(1.0, org.assertj.core.data.Offset.offset(1e-3));
        }
        assertThat(cosine(vectors.get(0), vectors.get(1))).isGreaterThan(cosine(vectors.get(0), vectors.get(2)));
    }

    private static double cosine(float[] a, float[] b) {
        double dot = 0;
        for (int i = 0; i < a.length; i++) {
            dot += a[i] * b[i];
        }
        return dot;
    }
}
