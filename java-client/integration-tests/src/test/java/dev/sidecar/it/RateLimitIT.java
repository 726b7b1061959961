package dev.sidecar.it;

import static org.assertj.core.api.Assertions.assertThat;
import static org.springframework.test.web.servlet.request.MockMvcRequestBuilders.post;

import dev.sidecar.client.RateLimitedException;
import dev.sidecar.client.SidecarClient;
import dev.sidecar.demo.ChatDemoApplication;
import dev.sidecar.v1.ChatRequest;
import dev.sidecar.v1.SamplingParams;
import java.time.Duration;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.extension.RegisterExtension;
import org.springframework.beans.factory.annotation.Autowired;
import org.springframework.boot.webmvc.test.autoconfigure.AutoConfigureMockMvc;
import org.springframework.boot.test.context.SpringBootTest;
import org.springframework.http.MediaType;
import org.springframework.mock.web.MockHttpServletResponse;
import org.springframework.test.context.DynamicPropertyRegistry;
import org.springframework.test.context.DynamicPropertySource;
import org.springframework.test.web.servlet.MockMvc;

/** The sidecar's rate limit as seen by the client (typed exception) and by the demo app (429). */
@SpringBootTest(classes = ChatDemoApplication.class, properties = {"sidecar.client.chat.max-tokens=2",
        "sidecar.client.max-retry-attempts=1"})
@AutoConfigureMockMvc
class RateLimitIT {

    @RegisterExtension
    static final RealSidecar SIDECAR = RealSidecar.with(ItArgs.RATE_LIMITED);

    @DynamicPropertySource
    static void sidecarTarget(DynamicPropertyRegistry registry) {
        registry.add("sidecar.client.target", () -> SIDECAR.process().grpcTarget());
    }

    @Autowired
    private MockMvc mvc;

    @Test
    void clientRaisesRateLimitedWithRetryAfter() {
        ChatRequest request = ChatRequest.newBuilder().addMessages(SidecarClient.user("hi"))
                .setSampling(SamplingParams.newBuilder().setMaxTokens(1)).build();
        try (SidecarClient client = SIDECAR.process().client()) {
            RateLimitedException limited = null;
            // Burst 1: of three immediate calls at least the later ones are refused.
            for (int i = 0; i < 3 && limited == null; i++) {
                try {
                    client.chat(request);
                } catch (RateLimitedException e) {
                    limited = e;
                }
            }
            assertThat(limited).as("a RESOURCE_EXHAUSTED rate limit").isNotNull();
            assertThat(limited.getRetryAfter()).isPresent();
            assertThat(limited.getRetryAfter().get()).isPositive().isLessThanOrEqualTo(Duration.ofSeconds(6));
        }
    }

    @Test
    void demoAppAnswers429WithRetryAfter() throws Exception {
        MockHttpServletResponse limited = null;
        for (int i = 0; i < 3 && limited == null; i++) {
            MockHttpServletResponse r = mvc.perform(post("/api/chat/message").header("X-Session-ID", "it-429")
                    .contentType(MediaType.APPLICATION_JSON).content("{\"message\":\"hello\"}")).andReturn().getResponse();
            if (r.getStatus() == 429) {
                limited = r;
            } else {
                assertThat(r.getStatus()).isEqualTo(200);
            }
        }
        assertThat(limited).as("a 429 from the demo app").isNotNull();
        assertThat(Integer.parseInt(limited.getHeader("Retry-After"))).isBetween(1, 6);
        assertThat(limited.getContentAsString()).contains("\"error\":\"rate_limited\"");
    }
}
