package dev.sidecar.it;

import static org.assertj.core.api.Assertions.assertThat;

import dev.sidecar.spring.SidecarAutoConfiguration;
import dev.sidecar.spring.SidecarChatModel;
import dev.sidecar.spring.SidecarChatOptions;
import java.time.Duration;
import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.extension.RegisterExtension;
import org.springframework.ai.chat.client.AdvisorParams;
import org.springframework.ai.chat.client.ChatClient;
import org.springframework.ai.chat.model.ChatResponse;
import org.springframework.ai.model.chat.client.autoconfigure.ChatClientAutoConfiguration;
import org.springframework.ai.tool.annotation.Tool;
import org.springframework.ai.tool.annotation.ToolParam;
import org.springframework.boot.autoconfigure.AutoConfigurations;
import org.springframework.boot.test.context.runner.ApplicationContextRunner;

/**
 * ChatClient's {@code .tools(obj)} and {@code .entity(Record.class)} over the starter against the real
 * sidecar (random demo model): the grammar makes a forced call's arguments valid, so the Java method
 * runs with arguments its schema allows, and the JSON-schema response format makes any reply parse.
 */
class ToolsAndStructuredOutputIT {

    @RegisterExtension
    static final RealSidecar SIDECAR = RealSidecar.with(ItArgs.DEFAULT);

    enum City { OSLO, LIMA, ROME }

    enum Sky { CLEAR, CLOUDY, RAIN }

    record Forecast(City city, Sky sky, boolean windy) {
    }

    static final class WeatherTools {
        final List<City> calls = new CopyOnWriteArrayList<>();

        @Tool(description = "Current temperature in a city")
        String currentTemperature(@ToolParam(description = "the city") City city) {
            calls.add(city);
            return "{\"city\": \"" + city + "\", \"celsius\": 21}";
        }
    }

    private ApplicationContextRunner runner() {
        return new ApplicationContextRunner()
                .withConfiguration(AutoConfigurations.of(SidecarAutoConfiguration.class,
                        ChatClientAutoConfiguration.class))
                .withPropertyValues("sidecar.client.target=" + SIDECAR.process().grpcTarget(),
                        "sidecar.client.chat.temperature=0");
    }

    @Test
    void toolsCallInvokesTheJavaMethodAndReturnsTheFinalAnswer() {
        runner().run(ctx -> {
            ChatClient client = ctx.getBean(ChatClient.Builder.class).build();
            WeatherTools tools = new WeatherTools();
            // Named choice: the first turn is one schema-valid call; the turn carrying its result is
            // free text, kept short (the demo model's text is random; its byte-level tokens make the call ~80 tokens).
            ChatResponse r = client.prompt().user("How warm is it in Oslo?").tools(tools)
                    .options(SidecarChatOptions.builder().toolChoiceFunction("currentTemperature").maxTokens(120))
                    .call().chatResponse();

            assertThat(tools.calls).hasSize(1);
            assertThat(tools.calls.get(0)).isIn((Object[]) City.values());
            assertThat(r.hasToolCalls()).isFalse();
            assertThat(r.getResult().getMetadata().getFinishReason()).isIn("STOP", "LENGTH");
            assertThat(r.getResult().getOutput().getText()).isNotNull();
            // Two rounds were made: the usage ChatClient reports covers the call's turn and the answer's.
            assertThat(r.getMetadata().getUsage().getCompletionTokens()).isGreaterThan(1);
        });
    }

    @Test
    void streamedToolsCallInvokesTheJavaMethodAndStreamsTheAnswer() {
        runner().run(ctx -> {
            ChatClient client = ChatClient.create(ctx.getBean(SidecarChatModel.class));
            WeatherTools tools = new WeatherTools();
            List<String> parts = client.prompt().user("How warm is it in Lima?").tools(tools)
                    .options(SidecarChatOptions.builder().toolChoiceRequired().parallelToolCalls(false).maxTokens(120))
                    .stream().content().collectList().block(Duration.ofSeconds(120));

            assertThat(tools.calls).hasSize(1);
            assertThat(parts).isNotNull();
        });
    }

    @Test
    void entityReturnsAPopulatedRecordThroughTheJsonSchema() {
        runner().run(ctx -> {
            ChatClient client = ctx.getBean(ChatClient.Builder.class).build();
            // No max tokens set: with a response format the sidecar allows the rest of the context, so
            // the JSON is never cut at the 64-token default.
            Forecast f = client.prompt().user("Forecast for Rome as JSON")
                    .advisors(AdvisorParams.ENABLE_NATIVE_STRUCTURED_OUTPUT).call().entity(Forecast.class);

            assertThat(f).isNotNull();
            assertThat(f.city()).isNotNull();
            assertThat(f.sky()).isNotNull();
        });
    }
}
