package dev.sidecar.demo;

import static org.assertj.core.api.Assertions.assertThat;
import static org.hamcrest.Matchers.matchesPattern;
import static org.springframework.test.web.servlet.request.MockMvcRequestBuilders.asyncDispatch;
import static org.springframework.test.web.servlet.request.MockMvcRequestBuilders.delete;
import static org.springframework.test.web.servlet.request.MockMvcRequestBuilders.get;
import static org.springframework.test.web.servlet.request.MockMvcRequestBuilders.post;
import static org.springframework.test.web.servlet.result.MockMvcResultMatchers.content;
import static org.springframework.test.web.servlet.result.MockMvcResultMatchers.header;
import static org.springframework.test.web.servlet.result.MockMvcResultMatchers.jsonPath;
import static org.springframework.test.web.servlet.result.MockMvcResultMatchers.request;
import static org.springframework.test.web.servlet.result.MockMvcResultMatchers.status;

import dev.sidecar.spring.SidecarClientCustomizer;
import dev.sidecar.v1.ChatMessage;
import dev.sidecar.v1.ChatRequest;
import io.grpc.Status;
import io.grpc.inprocess.InProcessChannelBuilder;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import org.springframework.beans.factory.annotation.Autowired;
import org.springframework.boot.webmvc.test.autoconfigure.AutoConfigureMockMvc;
import org.springframework.boot.test.context.SpringBootTest;
import org.springframework.boot.test.context.TestConfiguration;
import org.springframework.context.annotation.Bean;
import org.springframework.http.MediaType;
import org.springframework.test.web.servlet.MockMvc;
import org.springframework.test.web.servlet.MvcResult;
import org.springframework.test.web.servlet.request.MockHttpServletRequestBuilder;

@SpringBootTest(properties = {"sidecar.client.max-retry-attempts=1", "chat-demo.system-prompt=SYS",
        "chat-demo.max-turns=3", "chat-demo.rate-limit.requests-per-minute=6", "chat-demo.rate-limit.burst=6"})
@AutoConfigureMockMvc
class ChatControllerTest {

    @TestConfiguration
    static class InProcessSidecar {
        @Bean
        SidecarClientCustomizer inProcessChannel() {
            return b -> b.channelBuilder(InProcessChannelBuilder.forName(FakeSidecarServer.NAME));
        }
    }

    @Autowired
    private MockMvc mvc;

    @BeforeEach
    void reset() {
        FakeSidecarServer.reset();
    }

    private static MockHttpServletRequestBuilder message(String session, String json) {
        MockHttpServletRequestBuilder b = post("/api/chat/message").contentType(MediaType.APPLICATION_JSON).content(json);
        return session == null ? b : b.header("X-Session-ID", session);
    }

    @Test
    void multiTurnConversationSendsTheHistoryAsASharedPrefix() throws Exception {
        mvc.perform(message("s-multi", "{\"message\":\"hello\"}"))
                .andExpect(status().isOk())
                .andExpect(header().string("X-Session-ID", "s-multi"))
                .andExpect(jsonPath("$.reply").value("echo: hello"))
                .andExpect(jsonPath("$.sessionId").value("s-multi"))
                .andExpect(jsonPath("$.cached").value(false))
                .andExpect(jsonPath("$.turns").value(1));

        mvc.perform(message("s-multi", "{\"message\":\"again\"}"))
                .andExpect(status().isOk())
                .andExpect(jsonPath("$.turns").value(2))
                .andExpect(jsonPath("$.usage.promptTokens").value(40))
                .andExpect(jsonPath("$.usage.cachedTokens").value(30))
                .andExpect(jsonPath("$.finishReason").value("STOP"));

        FakeSidecarServer.CHATS.poll();
        ChatRequest second = FakeSidecarServer.CHATS.poll();
        assertThat(second.getMessagesList()).extracting(ChatMessage::getRole)
                .containsExactly("system", "user", "assistant", "user");
        assertThat(second.getMessagesList()).extracting(ChatMessage::getContent)
                .containsExactly("SYS", "hello", "echo: hello", "again");
    }

    @Test
    void historyIsBoundedToTheLatestTurns() throws Exception {
        for (int i = 0; i < 5; i++) {
            mvc.perform(message("s-bounded", "{\"message\":\"m" + i + "\"}")).andExpect(status().isOk());
        }
        ChatRequest last = FakeSidecarServer.CHATS.stream().reduce((a, b) -> b).orElseThrow();
        // system + 3 kept turns (6 messages) + the new user message
        assertThat(last.getMessagesCount()).isEqualTo(8);
        assertThat(last.getMessages(1).getContent()).isEqualTo("m1");
    }

    @Test
    void sessionsAreIndependentAndIssuedWhenMissing() throws Exception {
        mvc.perform(message("s-a", "{\"message\":\"one\"}")).andExpect(status().isOk());
        mvc.perform(message(null, "{\"message\":\"two\"}"))
                .andExpect(status().isOk())
                .andExpect(header().string("X-Session-ID", matchesPattern("[0-9a-f-]{36}")))
                .andExpect(jsonPath("$.turns").value(1));
        FakeSidecarServer.CHATS.poll();
        assertThat(FakeSidecarServer.CHATS.poll().getMessagesCount()).isEqualTo(2);
    }

    @Test
    void semanticCacheHitIsReported() throws Exception {
        mvc.perform(message("s-cache", "{\"message\":\"cached question\"}"))
                .andExpect(jsonPath("$.cached").value(true))
                .andExpect(jsonPath("$.cacheStatus").value("HIT_SEMANTIC"));
    }

    @Test
    void rateLimitBecomes429WithRetryAfterAndLeavesHistoryUntouched() throws Exception {
        FakeSidecarServer.failWith = Status.RESOURCE_EXHAUSTED.withDescription("rate limit exceeded");
        FakeSidecarServer.retryAfterMs = "2500";

        mvc.perform(message("s-429", "{\"message\":\"hi\"}"))
                .andExpect(status().isTooManyRequests())
                .andExpect(header().string("Retry-After", "3"))
                .andExpect(jsonPath("$.error").value("rate_limited"))
                .andExpect(jsonPath("$.retryAfterMs").value(2500));

        FakeSidecarServer.reset();
        mvc.perform(message("s-429", "{\"message\":\"hi\"}")).andExpect(jsonPath("$.turns").value(1));
    }

    @Test
    void sidecarDownBecomes503() throws Exception {
        FakeSidecarServer.failWith = Status.UNAVAILABLE.withDescription("draining");
        mvc.perform(message("s-503", "{\"message\":\"hi\"}"))
                .andExpect(status().isServiceUnavailable())
                .andExpect(jsonPath("$.error").value("sidecar_unavailable"));
    }

    @Test
    void badInputBecomes400NamingTheField() throws Exception {
        mvc.perform(message("s-400", "{\"message\":\"  \"}")).andExpect(status().isBadRequest())
                .andExpect(jsonPath("$.message").value("message: must not be blank"));
        mvc.perform(message("bad id!", "{\"message\":\"x\"}")).andExpect(status().isBadRequest())
                .andExpect(jsonPath("$.message", matchesPattern("X-Session-ID.*")));
        mvc.perform(message("s-400", "{not json")).andExpect(status().isBadRequest());
        mvc.perform(message("s-400", "{\"message\":\"" + "x".repeat(8001) + "\"}"))
                .andExpect(status().isBadRequest());
        assertThat(FakeSidecarServer.CHATS).isEmpty();

        FakeSidecarServer.failWith = Status.INVALID_ARGUMENT.withDescription("messages: prompt too long");
        mvc.perform(message("s-400", "{\"message\":\"x\"}")).andExpect(status().isBadRequest())
                .andExpect(jsonPath("$.message", matchesPattern(".*messages: prompt too long.*")));
    }

    @Test
    void streamSendsDeltasThenDoneAndRecordsTheTurn() throws Exception {
        MvcResult started = mvc.perform(post("/api/chat/stream").header("X-Session-ID", "s-stream")
                        .contentType(MediaType.APPLICATION_JSON).content("{\"message\":\"flow\"}"))
                .andExpect(request().asyncStarted()).andReturn();
        MvcResult done = mvc.perform(asyncDispatch(started)).andReturn();
        // The emitter writes asynchronously; wait until the final event is complete.
        long end = System.nanoTime() + 5_000_000_000L;
        while (!done.getResponse().getContentAsString().matches("(?s).*event:done\\ndata:\\{.*}\\n\\n")
                && System.nanoTime() < end) {
            Thread.sleep(10);
        }
        String body = done.getResponse().getContentAsString();
        assertThat(done.getResponse().getContentType()).startsWith("text/event-stream");
        assertThat(body).contains("event:delta", "{\"text\":\"echo: \"}", "{\"text\":\"flow\"}", "event:done",
                "\"finishReason\":\"STOP\"");
        assertThat(body.indexOf("event:done")).isGreaterThan(body.lastIndexOf("event:delta"));
        assertThat(done.getResponse().getHeader("X-Session-ID")).isEqualTo("s-stream");

        mvc.perform(message("s-stream", "{\"message\":\"next\"}")).andExpect(jsonPath("$.turns").value(2));
    }

    @Test
    void streamRateLimitedBeforeAnyOutputIs429() throws Exception {
        FakeSidecarServer.failWith = Status.RESOURCE_EXHAUSTED.withDescription("queue full");
        FakeSidecarServer.retryAfterMs = "400";
        MvcResult started = mvc.perform(post("/api/chat/stream").header("X-Session-ID", "s-s429")
                        .contentType(MediaType.APPLICATION_JSON).content("{\"message\":\"x\"}"))
                .andExpect(request().asyncStarted()).andReturn();
        mvc.perform(asyncDispatch(started))
                .andExpect(status().isTooManyRequests())
                .andExpect(header().string("Retry-After", "1"))
                .andExpect(content().contentTypeCompatibleWith(MediaType.APPLICATION_JSON));
    }

    @Test
    void eachSessionHasItsOwnRateLimit() throws Exception {
        for (int i = 0; i < 6; i++) {
            mvc.perform(message("s-busy", "{\"message\":\"m" + i + "\"}")).andExpect(status().isOk());
        }
        mvc.perform(message("s-busy", "{\"message\":\"one too many\"}"))
                .andExpect(status().isTooManyRequests())
                .andExpect(header().string("Retry-After", matchesPattern("[1-9][0-9]*")))
                .andExpect(jsonPath("$.error").value("rate_limited"))
                .andExpect(jsonPath("$.message", matchesPattern("session s-busy: .*")));
        // Another session is not affected, and the refused turn never reached the sidecar.
        mvc.perform(message("s-quiet", "{\"message\":\"hi\"}")).andExpect(status().isOk());
        assertThat(FakeSidecarServer.CHATS).hasSize(7);
    }

    @Test
    void streamIssuesTheSessionHeaderEvenOnErrors() throws Exception {
        FakeSidecarServer.failWith = Status.UNAVAILABLE.withDescription("draining");
        MvcResult started = mvc.perform(post("/api/chat/stream")
                        .contentType(MediaType.APPLICATION_JSON).content("{\"message\":\"x\"}"))
                .andExpect(request().asyncStarted()).andReturn();
        mvc.perform(asyncDispatch(started))
                .andExpect(status().isServiceUnavailable())
                .andExpect(header().string("X-Session-ID", matchesPattern("[0-9a-f-]{36}")));
    }

    @Test
    void prometheusEndpointExposesSpringAisTokenUsageMeter() throws Exception {
        mvc.perform(message("s-prom", "{\"message\":\"count me\"}")).andExpect(status().isOk());
        String scrape = mvc.perform(get("/actuator/prometheus")).andExpect(status().isOk())
                .andReturn().getResponse().getContentAsString();
        assertThat(scrape).contains("gen_ai_client_token_usage_total{")
                .contains("gen_ai_system=\"sidecar\"").contains("gen_ai_token_type=\"input\"");
    }

    @Test
    void deleteSessionForgetsHistory() throws Exception {
        mvc.perform(message("s-del", "{\"message\":\"x\"}")).andExpect(status().isOk());
        mvc.perform(delete("/api/chat/session").header("X-Session-ID", "s-del")).andExpect(status().isNoContent());
        mvc.perform(delete("/api/chat/session").header("X-Session-ID", "s-del")).andExpect(status().isNotFound());
        mvc.perform(message("s-del", "{\"message\":\"y\"}")).andExpect(jsonPath("$.turns").value(1));
    }
}
