package dev.sidecar.it;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import dev.sidecar.client.SidecarClient;
import dev.sidecar.client.UnauthenticatedException;
import dev.sidecar.spring.SidecarAutoConfiguration;
import java.time.Duration;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.extension.RegisterExtension;
import org.springframework.ai.chat.model.ChatModel;
import org.springframework.ai.retry.NonTransientAiException;
import org.springframework.boot.autoconfigure.AutoConfigurations;
import org.springframework.boot.test.context.runner.ApplicationContextRunner;

/** A sidecar started with an API key: the client's key, and the typed errors without it. */
class AuthIT {

    @RegisterExtension
    static final RealSidecar SIDECAR = RealSidecar.with("--num-kv-blocks", "64", "--api-key", "it-secret:it-tenant");

    private SidecarClient client(String key) {
        return SidecarClient.builder().target(SIDECAR.process().grpcTarget()).apiKey(key)
                .defaultDeadline(Duration.ofSeconds(30)).build();
    }

    @Test
    void callsWithoutOrWithAWrongKeyAreUnauthenticated() {
        try (SidecarClient none = client(null); SidecarClient wrong = client("not-it")) {
            assertThatThrownBy(() -> none.generate("hi")).isInstanceOf(UnauthenticatedException.class);
            assertThatThrownBy(() -> wrong.generate("hi")).isInstanceOf(UnauthenticatedException.class);
            assertThatThrownBy(() -> wrong.chatStream(dev.sidecar.v1.ChatRequest.newBuilder()
                    .addMessages(SidecarClient.user("hi")).build()).blockLast(Duration.ofSeconds(30)))
                    .isInstanceOf(UnauthenticatedException.class);
        }
    }

    @Test
    void theRightKeyIsAccepted() {
        try (SidecarClient ok = client("it-secret")) {
            assertThat(ok.generate(dev.sidecar.v1.GenerateRequest.newBuilder().setPrompt("hi")
                    .setSampling(dev.sidecar.v1.SamplingParams.newBuilder().setMaxTokens(2)).build())
                    .getUsage().getCompletionTokens()).isPositive();
        }
    }

    @Test
    void theStartersChatModelReportsAMissingKeyAsNonTransient() {
        new ApplicationContextRunner()
                .withConfiguration(AutoConfigurations.of(SidecarAutoConfiguration.class))
                .withPropertyValues("sidecar.client.target=" + SIDECAR.process().grpcTarget(),
                        "sidecar.client.api-key=wrong")
                .run(ctx -> assertThatThrownBy(() -> ctx.getBean(ChatModel.class).call("hi"))
                        .isInstanceOf(NonTransientAiException.class)
                        .hasCauseInstanceOf(UnauthenticatedException.class));
        new ApplicationContextRunner()
                .withConfiguration(AutoConfigurations.of(SidecarAutoConfiguration.class))
                .withPropertyValues("sidecar.client.target=" + SIDECAR.process().grpcTarget(),
                        "sidecar.client.api-key=it-secret", "sidecar.client.chat.max-tokens=2")
                .run(ctx -> assertThat(ctx.getBean(ChatModel.class).call("hi")).isNotNull());
    }
}
