package dev.sidecar.it;

import static org.assertj.core.api.Assertions.assertThat;

import tools.jackson.databind.JsonNode;
import tools.jackson.databind.ObjectMapper;
import tools.jackson.databind.json.JsonMapper;
import dev.sidecar.demo.ChatDemoApplication;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.extension.RegisterExtension;
import org.springframework.boot.test.context.SpringBootTest;
import org.springframework.boot.test.web.server.LocalServerPort;
import org.springframework.test.context.DynamicPropertyRegistry;
import org.springframework.test.context.DynamicPropertySource;

/** The demo app over real HTTP against the real sidecar. */
@SpringBootTest(classes = ChatDemoApplication.class, webEnvironment = SpringBootTest.WebEnvironment.RANDOM_PORT,
        properties = {"sidecar.client.chat.max-tokens=4", "sidecar.client.chat.temperature=0",
                "chat-demo.system-prompt=You are the assistant of an integration test. Keep every answer short."})
class DemoAppIT {

    @RegisterExtension
    static final RealSidecar SIDECAR = RealSidecar.with(ItArgs.DEFAULT);

    @DynamicPropertySource
    static void sidecarTarget(DynamicPropertyRegistry registry) {
        registry.add("sidecar.client.target", () -> SIDECAR.process().grpcTarget());
    }

    @LocalServerPort
    private int port;

    private final HttpClient http = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(5)).build();
    private final ObjectMapper json = JsonMapper.builder().build();

    private HttpResponse<String> post(String path, String session, String message) throws Exception {
        HttpRequest req = HttpRequest.newBuilder(URI.create("http://127.0.0.1:" + port + path))
                .header("Content-Type", "application/json").header("X-Session-ID", session)
                .timeout(Duration.ofSeconds(60))
                .POST(HttpRequest.BodyPublishers.ofString(json.writeValueAsString(java.util.Map.of("message", message))))
                .build();
        return http.send(req, HttpResponse.BodyHandlers.ofString());
    }

    @Test
    void secondTurnOfASessionHitsThePrefixCache() throws Exception {
        HttpResponse<String> first = post("/api/chat/message", "it-session", "Hello there, who are you?");
        assertThat(first.statusCode()).as(first.body()).isEqualTo(200);
        JsonNode a = json.readTree(first.body());
        assertThat(a.get("sessionId").asText()).isEqualTo("it-session");
        assertThat(a.get("turns").asInt()).isEqualTo(1);

        HttpResponse<String> second = post("/api/chat/message", "it-session", "And what can you do?");
        JsonNode b = json.readTree(second.body());
        assertThat(b.get("turns").asInt()).isEqualTo(2);
        // The second prompt starts with the first prompt and its answer.
        assertThat(b.get("usage").get("promptTokens").asInt()).isGreaterThan(a.get("usage").get("promptTokens").asInt());
        assertThat(b.get("usage").get("cachedTokens").asInt()).isGreaterThanOrEqualTo(16);
    }

    @Test
    void streamEndpointSendsServerSentEvents() throws Exception {
        HttpResponse<String> r = post("/api/chat/stream", "it-stream", "Stream a short answer.");
        assertThat(r.statusCode()).isEqualTo(200);
        assertThat(r.headers().firstValue("Content-Type").orElse("")).startsWith("text/event-stream");
        assertThat(r.body()).contains("event:done").contains("\"sessionId\":\"it-stream\"");
    }

    @Test
    void blankMessageIs400() throws Exception {
        HttpResponse<String> r = post("/api/chat/message", "it-400", " ");
        assertThat(r.statusCode()).isEqualTo(400);
        assertThat(r.body()).contains("message: must not be blank");
    }
}
