package dev.sidecar.it;

import static org.assertj.core.api.Assertions.assertThat;

import dev.sidecar.spring.SidecarAutoConfiguration;
import dev.sidecar.spring.SidecarChatModel;
import java.time.Duration;
import java.util.List;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.extension.RegisterExtension;
import org.springframework.ai.chat.client.AdvisorParams;
import org.springframework.ai.chat.client.ChatClient;
import org.springframework.ai.model.chat.client.autoconfigure.ChatClientAutoConfiguration;
import org.springframework.boot.autoconfigure.AutoConfigurations;
import org.springframework.boot.test.context.runner.ApplicationContextRunner;

/** Spring AI's ChatClient over the starter against the sidecar serving its trained default model. */
class RealModelIT {

    @RegisterExtension
    static final RealSidecar SIDECAR = RealSidecar.with(ItArgs.REAL_MODEL);

    private ApplicationContextRunner runner() {
        return new ApplicationContextRunner()
                .withConfiguration(AutoConfigurations.of(SidecarAutoConfiguration.class,
                        ChatClientAutoConfiguration.class))
                .withPropertyValues("sidecar.client.target=" + SIDECAR.process().grpcTarget(),
                        "sidecar.client.chat.max-tokens=24", "sidecar.client.chat.temperature=0");
    }

    @Test
    void answersTheCapitalOfFranceCalledAndStreamed() {
        runner().run(ctx -> {
            ChatClient client = ChatClient.create(ctx.getBean(SidecarChatModel.class));
            String called = client.prompt().user("What is the capital of France?").call().content();
            assertThat(called).contains("Paris");
            List<String> streamed = client.prompt().user("What is the capital of France?")
                    .stream().content().collectList().block(Duration.ofSeconds(60));
            assertThat(String.join("", streamed)).isEqualTo(called);
        });
    }

    record Capital(String city, String country) {
    }

    @Test
    void entityFillsARecordFromTheSchemaConstrainedAnswer() {
        // No max tokens configured: with a response format the sidecar then lets the JSON run to its end.
        new ApplicationContextRunner()
                .withConfiguration(AutoConfigurations.of(SidecarAutoConfiguration.class,
                        ChatClientAutoConfiguration.class))
                .withPropertyValues("sidecar.client.target=" + SIDECAR.process().grpcTarget(),
                        "sidecar.client.chat.temperature=0")
                .run(ctx -> {
                    Capital c = ChatClient.create(ctx.getBean(SidecarChatModel.class)).prompt()
                            .user("What is the capital of France? Give the city and the country.")
                            .advisors(AdvisorParams.ENABLE_NATIVE_STRUCTURED_OUTPUT).call().entity(Capital.class);
                    assertThat(c.city()).contains("Paris");
                    assertThat(c.country()).contains("France");
                });
    }
}
