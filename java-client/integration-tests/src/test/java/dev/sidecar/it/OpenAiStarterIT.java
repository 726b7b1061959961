package dev.sidecar.it;

import static org.assertj.core.api.Assertions.assertThat;

import java.time.Duration;
import java.util.List;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.extension.RegisterExtension;
import org.springframework.ai.chat.client.ChatClient;
import org.springframework.ai.chat.model.ChatModel;
import org.springframework.ai.chat.model.ChatResponse;
import org.springframework.ai.openai.OpenAiChatModel;
import org.springframework.beans.factory.annotation.Autowired;
import org.springframework.boot.SpringBootConfiguration;
import org.springframework.boot.autoconfigure.EnableAutoConfiguration;
import org.springframework.boot.test.context.SpringBootTest;
import org.springframework.test.context.DynamicPropertyRegistry;
import org.springframework.test.context.DynamicPropertySource;

/** Spring AI's stock OpenAI starter, pointed at the sidecar's OpenAI-compatible HTTP API. */
@SpringBootTest(classes = OpenAiStarterIT.App.class, webEnvironment = SpringBootTest.WebEnvironment.NONE,
        properties = {"spring.ai.model.chat=openai", "spring.ai.model.embedding=none",
                "spring.ai.model.image=none", "spring.ai.model.audio.speech=none",
                "spring.ai.model.audio.transcription=none", "spring.ai.model.moderation=none",
                "spring.ai.openai.api-key=none", "spring.ai.openai.chat.options.model=demo",
                "spring.ai.openai.chat.options.max-tokens=6", "spring.ai.openai.chat.options.temperature=0"})
class OpenAiStarterIT {

    @SpringBootConfiguration
    @EnableAutoConfiguration
    static class App {
    }

    @RegisterExtension
    static final RealSidecar SIDECAR = RealSidecar.with(ItArgs.DEFAULT);

    @DynamicPropertySource
    static void baseUrl(DynamicPropertyRegistry registry) {
        // Spring AI 2.0 uses the official OpenAI Java SDK, whose base URL includes /v1.
        registry.add("spring.ai.openai.base-url", () -> SIDECAR.process().httpBase() + "/v1");
    }

    @Autowired
    private ChatModel chatModel;

    @Autowired
    private org.springframework.context.ApplicationContext context;

    @Test
    void theSidecarStarterOnTheClasspathCreatesNothingWhenAnotherProviderIsSelected() {
        // spring.ai.model.chat=openai and spring.ai.model.embedding=none: no sidecar model is selected.
        assertThat(context.getBeanNamesForType(dev.sidecar.client.SidecarClient.class)).isEmpty();
        assertThat(context.getBeanNamesForType(dev.sidecar.spring.SidecarHealthIndicator.class)).isEmpty();
        assertThat(context.getBeanNamesForType(dev.sidecar.spring.SidecarChatModel.class)).isEmpty();
    }

    @Test
    void callCompletesWithUsage() {
        assertThat(chatModel).isInstanceOf(OpenAiChatModel.class);
        ChatResponse r = ChatClient.create(chatModel).prompt().system("You are terse.").user("Say hi.")
                .call().chatResponse();
        assertThat(r.getResult().getOutput().getText()).isNotNull();
        assertThat(r.getMetadata().getUsage().getCompletionTokens()).isBetween(1, 6);
        assertThat(r.getMetadata().getModel()).isEqualTo("demo");
    }

    @Test
    void streamMatchesTheGreedyCall() {
        String called = ChatClient.create(chatModel).prompt().user("Count to three.").call().content();
        List<String> streamed = ChatClient.create(chatModel).prompt().user("Count to three.").stream().content()
                .collectList().block(Duration.ofSeconds(60));
        assertThat(String.join("", streamed)).isEqualTo(called);
    }
}
