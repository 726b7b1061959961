package dev.sidecar.spring;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import dev.sidecar.client.SidecarClient;
import dev.sidecar.v1.ChatRequest;
import dev.sidecar.v1.Completion;
import dev.sidecar.v1.CompletionChunk;
import dev.sidecar.v1.FinishReason;
import dev.sidecar.v1.Usage;
import java.time.Duration;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import org.springframework.ai.chat.client.ChatClient;
import org.springframework.ai.chat.model.ChatResponse;
import org.springframework.ai.chat.prompt.Prompt;

/**
 * A thinking model's reasoning lands in the assistant message's metadata (where Spring AI's own chat models
 * put it); reasoning effort and logit bias reach the wire.
 */
class SidecarReasoningTest {

    private FakeSidecar sidecar;
    private SidecarClient client;
    private SidecarChatModel model;

    @BeforeEach
    void setUp() throws Exception {
        sidecar = new FakeSidecar();
        client = SidecarClient.builder().channelBuilder(sidecar.channelBuilder()).build();
        model = SidecarChatModel.builder().client(client).build();
    }

    @AfterEach
    void tearDown() throws Exception {
        client.close();
        sidecar.close();
    }

    @Test
    void chatClientSeesTheAnswerAndTheReasoningApart() {
        sidecar.replies.add(Completion.newBuilder().setRequestId("r1").setText("Five.").setReasoning("2 + 3 = 5")
                .setFinishReason(FinishReason.FINISH_REASON_STOP)
                .setUsage(Usage.newBuilder().setPromptTokens(9).setCompletionTokens(12).setTotalTokens(21)
                        .setReasoningTokens(8))
                .build());
        ChatResponse r = ChatClient.create(model).prompt().user("2+3?").call().chatResponse();

        assertThat(r.getResult().getOutput().getText()).isEqualTo("Five.");
        assertThat(r.getResult().getOutput().getMetadata()).containsEntry("reasoningContent", "2 + 3 = 5");
        assertThat((Integer) r.getMetadata().get(SidecarChatModel.REASONING_TOKENS)).isEqualTo(8);
        assertThat(r.getMetadata().getUsage().getCompletionTokens()).isEqualTo(12);
    }

    @Test
    void aReplyWithoutReasoningHasNoReasoningMetadata() {
        ChatResponse r = model.call(new Prompt("plain"));
        assertThat(r.getResult().getOutput().getText()).isEqualTo("echo: plain");
        assertThat(r.getResult().getOutput().getMetadata()).doesNotContainKey("reasoningContent");
        assertThat(r.getMetadata().containsKey(SidecarChatModel.REASONING_TOKENS)).isFalse();
    }

    @Test
    void streamedReasoningArrivesInEachChunksMetadata() {
        sidecar.streamReplies.add(List.of(
                CompletionChunk.newBuilder().setRequestId("s").setReasoningDelta("think ").build(),
                CompletionChunk.newBuilder().setRequestId("s").setReasoningDelta("more").build(),
                CompletionChunk.newBuilder().setRequestId("s").setDelta("Done.")
                        .setFinishReason(FinishReason.FINISH_REASON_STOP).build()));
        List<ChatResponse> chunks = model.stream(new Prompt("q")).collectList().block(Duration.ofSeconds(5));

        assertThat(chunks).extracting(c -> (String) c.getResult().getOutput().getMetadata().get("reasoningContent"))
                .containsExactly("think ", "more", null);
        assertThat(chunks).extracting(c -> c.getResult().getOutput().getText()).containsExactly("", "", "Done.");
    }

    @Test
    void reasoningEffortAndLogitBiasReachTheRequest() {
        Map<String, Integer> bias = new LinkedHashMap<>();
        bias.put("42", 100);
        bias.put("7", -100);
        ChatClient.create(model).prompt().user("hi")
                .options(SidecarChatOptions.builder().reasoningEffort("none").logitBias(bias))
                .call().content();
        ChatRequest sent = sidecar.chats.poll();
        assertThat(sent.getReasoningEffort()).isEqualTo("none");
        assertThat(sent.getSampling().getLogitBiasMap()).containsExactlyInAnyOrderEntriesOf(Map.of(42, 100f, 7, -100f));

        SidecarChatOptions o = SidecarChatOptions.builder().logitBias(bias).reasoningEffort("low").build();
        assertThat(o.copy()).isEqualTo(o);
        assertThat(SidecarChatOptions.merge(SidecarChatOptions.builder().build(), o).getReasoningEffort())
                .isEqualTo("low");

        assertThatThrownBy(() -> model.call(new Prompt("x", SidecarChatOptions.builder()
                .logitBias(Map.of("the", 5)).build())))
                .isInstanceOf(IllegalArgumentException.class).hasMessageContaining("options.logitBias");
    }
}
