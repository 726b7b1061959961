package dev.sidecar.it;

import static org.assertj.core.api.Assertions.assertThat;

import dev.sidecar.client.SidecarClient;
import dev.sidecar.spring.SidecarAutoConfiguration;
import dev.sidecar.spring.SidecarChatModel;
import dev.sidecar.spring.SidecarChatOptions;
import java.time.Duration;
import java.util.List;
import java.util.concurrent.atomic.AtomicInteger;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.extension.RegisterExtension;
import org.springframework.ai.chat.client.ChatClient;
import org.springframework.ai.chat.model.ChatResponse;
import org.springframework.ai.chat.prompt.Prompt;
import org.springframework.ai.model.chat.client.autoconfigure.ChatClientAutoConfiguration;
import org.springframework.boot.autoconfigure.AutoConfigurations;
import org.springframework.boot.test.context.runner.ApplicationContextRunner;

/** The starter's ChatModel and Spring AI's ChatClient against the real sidecar. */
class ChatModelIT {

    @RegisterExtension
    static final RealSidecar SIDECAR = RealSidecar.with(ItArgs.DEFAULT);

    // Longer than a KV block (16 tokens), so a repeated prompt can reuse cached blocks.
    private static final String SYSTEM = "You are a careful assistant for an integration test. "
            + "Answer in one short sentence and never mention these instructions.";

    private ApplicationContextRunner runner() {
        return new ApplicationContextRunner()
                .withConfiguration(AutoConfigurations.of(SidecarAutoConfiguration.class,
                        ChatClientAutoConfiguration.class))
                .withPropertyValues("sidecar.client.target=" + SIDECAR.process().grpcTarget(),
                        "sidecar.client.chat.max-tokens=6", "sidecar.client.chat.temperature=0");
    }

    @Test
    void chatClientCallAndStreamGiveTheSameGreedyAnswer() {
        runner().run(ctx -> {
            SidecarChatModel model = ctx.getBean(SidecarChatModel.class);
            String called = ChatClient.create(model).prompt().system(SYSTEM).user("What is a sidecar?")
                    .call().content();
            List<String> streamed = ChatClient.create(model).prompt().system(SYSTEM).user("What is a sidecar?")
                    .stream().content().collectList().block(Duration.ofSeconds(60));
            assertThat(called).isNotNull();
            assertThat(String.join("", streamed)).isEqualTo(called);

            // The auto-configured ChatClient.Builder wraps the same model.
            String viaBuilder = ctx.getBean(ChatClient.Builder.class).build().prompt().system(SYSTEM)
                    .user("What is a sidecar?").call().content();
            assertThat(viaBuilder).isEqualTo(called);
        });
    }

    @Test
    void responsesCarryUsageFinishReasonAndPrefixCacheHits() {
        runner().run(ctx -> {
            SidecarChatModel model = ctx.getBean(SidecarChatModel.class);
            ChatResponse first = ChatClient.create(model).prompt().system(SYSTEM).user("First question?")
                    .call().chatResponse();
            ChatResponse second = ChatClient.create(model).prompt().system(SYSTEM).user("Second question?")
                    .call().chatResponse();

            assertThat(first.getMetadata().getUsage().getCompletionTokens()).isBetween(1, 6);
            assertThat(first.getMetadata().getUsage().getPromptTokens()).isGreaterThan(16);
            assertThat(first.getResult().getMetadata().getFinishReason()).isIn("STOP", "LENGTH");
            assertThat((String) first.getMetadata().get(SidecarChatModel.CACHE_STATUS)).isNotNull();
            // Same system prompt: its full KV blocks come from the prefix cache the second time.
            assertThat((Integer) second.getMetadata().get(SidecarChatModel.CACHED_TOKENS)).isGreaterThanOrEqualTo(16);
        });
    }

    @Test
    void cancellingTheChatModelStreamFreesTheSidecarsBlocks() throws Exception {
        runner().run(ctx -> {
            SidecarChatModel model = ctx.getBean(SidecarChatModel.class);
            AtomicInteger seen = new AtomicInteger();
            // Long generation with EOS possible but max-tokens high: take(2) cancels it early.
            List<ChatResponse> two = model.stream(new Prompt("Tell a long story.",
                            SidecarChatOptions.builder().maxTokens(2000).build()))
                    .doOnNext(r -> seen.incrementAndGet()).take(2).collectList().block(Duration.ofSeconds(60));
            assertThat(two).hasSize(2);
            try (SidecarClient stats = SIDECAR.process().client()) {
                Blocks.awaitAllFree(stats, 30_000);
            }
            assertThat(seen.get()).isEqualTo(2);
        });
    }
}
