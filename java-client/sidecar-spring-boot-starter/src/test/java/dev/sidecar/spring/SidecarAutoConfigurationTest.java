package dev.sidecar.spring;

import static org.assertj.core.api.Assertions.assertThat;

import dev.sidecar.client.SidecarClient;
import io.grpc.health.v1.HealthCheckResponse.ServingStatus;
import io.micrometer.observation.ObservationRegistry;
import java.time.Duration;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import org.springframework.ai.chat.client.ChatClient;
import org.springframework.ai.chat.model.ChatModel;
import org.springframework.ai.embedding.EmbeddingModel;
import org.springframework.ai.model.chat.client.autoconfigure.ChatClientAutoConfiguration;
import org.springframework.boot.health.contributor.Status;
import io.micrometer.core.instrument.MeterRegistry;
import io.micrometer.core.instrument.simple.SimpleMeterRegistry;
import io.micrometer.observation.tck.TestObservationRegistry;
import io.micrometer.observation.tck.TestObservationRegistryAssert;
import org.springframework.ai.chat.observation.ChatModelMeterObservationHandler;
import org.springframework.ai.chat.observation.ChatModelObservationConvention;
import org.springframework.ai.chat.observation.DefaultChatModelObservationConvention;
import org.springframework.ai.embedding.observation.DefaultEmbeddingModelObservationConvention;
import org.springframework.ai.embedding.observation.EmbeddingModelObservationConvention;
import org.springframework.ai.model.chat.observation.autoconfigure.ChatObservationAutoConfiguration;
import org.springframework.ai.model.embedding.observation.autoconfigure.EmbeddingObservationAutoConfiguration;
import org.springframework.boot.autoconfigure.AutoConfigurations;
import org.springframework.boot.micrometer.observation.autoconfigure.ObservationAutoConfiguration;
import org.springframework.boot.test.context.runner.ApplicationContextRunner;
import org.springframework.context.annotation.Bean;
import org.springframework.context.annotation.Configuration;
import org.springframework.util.unit.DataSize;
import dev.sidecar.v1.Completion;
import dev.sidecar.v1.FinishReason;
import dev.sidecar.v1.ToolCall;
import java.util.List;
import java.util.concurrent.atomic.AtomicInteger;
import org.springframework.ai.chat.model.ChatResponse;
import org.springframework.ai.chat.prompt.Prompt;
import org.springframework.ai.model.tool.ToolCallingChatOptions;
import org.springframework.ai.model.tool.ToolCallingManager;
import org.springframework.ai.model.tool.ToolExecutionResult;
import org.springframework.ai.tool.definition.ToolDefinition;

class SidecarAutoConfigurationTest {

    private FakeSidecar sidecar;
    private ApplicationContextRunner runner;

    @BeforeEach
    void setUp() throws Exception {
        sidecar = new FakeSidecar();
        // Route the auto-configured client to the in-process fake; everything else is real.
        runner = new ApplicationContextRunner()
                .withConfiguration(AutoConfigurations.of(SidecarAutoConfiguration.class,
                        ChatClientAutoConfiguration.class))
                .withBean(SidecarClientCustomizer.class, () -> b -> b.channelBuilder(sidecar.channelBuilder()));
    }

    @AfterEach
    void tearDown() throws Exception {
        sidecar.close();
    }

    @Test
    void providesClientModelsHealthAndChatClientBuilder() {
        runner.run(ctx -> {
            assertThat(ctx).hasSingleBean(SidecarClient.class).hasSingleBean(ChatModel.class)
                    .hasSingleBean(EmbeddingModel.class).hasSingleBean(SidecarHealthIndicator.class)
                    .hasSingleBean(ChatClient.Builder.class);
            String reply = ctx.getBean(ChatClient.Builder.class).build().prompt().user("wired").call().content();
            assertThat(reply).isEqualTo("echo: wired");
            assertThat(ctx.getBean(SidecarHealthIndicator.class).health().getStatus()).isEqualTo(Status.UP);
        });
    }

    @Test
    void toolsThroughTheAutoConfiguredChatClientUseTheApplicationsToolCallingManager() {
        AtomicInteger resolved = new AtomicInteger();
        ToolCallingManager standard = ToolCallingManager.builder().build();
        ToolCallingManager counting = new ToolCallingManager() {
            @Override
            public List<ToolDefinition> resolveToolDefinitions(ToolCallingChatOptions options) {
                resolved.incrementAndGet();
                return standard.resolveToolDefinitions(options);
            }

            @Override
            public ToolExecutionResult executeToolCalls(Prompt prompt, ChatResponse response) {
                return standard.executeToolCalls(prompt, response);
            }
        };
        sidecar.replies.add(Completion.newBuilder().addToolCalls(ToolCall.newBuilder()
                        .setId("c1").setType("function").setName("currentWeather").setArguments("{\"city\":\"Oslo\"}"))
                .setFinishReason(FinishReason.FINISH_REASON_TOOL_CALLS).build());
        runner.withBean(ToolCallingManager.class, () -> counting).run(ctx -> {
            SidecarToolCallingTest.WeatherTools tools = new SidecarToolCallingTest.WeatherTools();
            String reply = ctx.getBean(ChatClient.Builder.class).build().prompt().user("weather?").tools(tools)
                    .call().content();
            assertThat(tools.calls).containsExactly("Oslo");
            assertThat(reply).isEqualTo("echo: 21 C in Oslo");  // the fake echoes the tool message back
            assertThat(resolved.get()).isEqualTo(2);  // each turn's definitions came from the bean
        });
    }

    @Test
    void bindsProperties() {
        runner.withPropertyValues("sidecar.client.target=dns:///sidecar:50051", "sidecar.client.api-key=k1",
                "sidecar.client.deadline=5s", "sidecar.client.max-message-size=1MB",
                "sidecar.client.chat.max-tokens=48", "sidecar.client.chat.temperature=0.3",
                "sidecar.client.chat.seed=11", "sidecar.client.chat.stop=END,STOP").run(ctx -> {
            SidecarProperties p = ctx.getBean(SidecarProperties.class);
            assertThat(p.getTarget()).isEqualTo("dns:///sidecar:50051");
            assertThat(p.getApiKey()).isEqualTo("k1");
            assertThat(p.getMaxMessageSize()).isEqualTo(DataSize.ofMegabytes(1));
            assertThat(ctx.getBean(SidecarClient.class).defaultDeadline()).isEqualTo(Duration.ofSeconds(5));
            SidecarChatOptions o = (SidecarChatOptions) ctx.getBean(ChatModel.class).getOptions();
            assertThat(o.getMaxTokens()).isEqualTo(48);
            assertThat(o.getTemperature()).isEqualTo(0.3);
            assertThat(o.getSeed()).isEqualTo(11L);
            assertThat(o.getStopSequences()).containsExactly("END", "STOP");

            ctx.getBean(ChatModel.class).call("bound?");
            assertThat(sidecar.chats.peek().getSampling().getMaxTokens()).isEqualTo(48);
        });
    }

    @Test
    void apiKeyPropertyIsSentAsBearerAndBlankSendsNone() {
        runner.withPropertyValues("sidecar.client.api-key=k2").run(ctx -> ctx.getBean(ChatModel.class).call("a"));
        assertThat(sidecar.authorizations.poll()).isEqualTo("Bearer k2");
        runner.withPropertyValues("sidecar.client.api-key=").run(ctx -> ctx.getBean(ChatModel.class).call("b"));
        assertThat(sidecar.authorizations.poll()).isEqualTo("<none>");
    }

    @Configuration(proxyBeanMethods = false)
    static class OwnBeans {
        static final SidecarChatModel MODEL = SidecarChatModel.builder().client(SidecarClient.builder().build()).build();

        @Bean
        SidecarChatModel myChatModel() {
            return MODEL;
        }
    }

    @Test
    void backsOffWhenTheApplicationDefinesItsOwnBeans() {
        runner.withUserConfiguration(OwnBeans.class).run(ctx -> {
            assertThat(ctx).hasSingleBean(SidecarChatModel.class);
            assertThat(ctx.getBean(SidecarChatModel.class)).isSameAs(OwnBeans.MODEL);
        });
        SidecarClient own = SidecarClient.builder().channelBuilder(sidecar.channelBuilder()).build();
        try {
            runner.withBean("mine", SidecarClient.class, () -> own).run(ctx -> {
                assertThat(ctx).hasSingleBean(SidecarClient.class);
                assertThat(ctx.getBean(SidecarClient.class)).isSameAs(own);
            });
        } finally {
            own.close();
        }
    }

    @Test
    void anotherSelectedProviderForBothModelsLeavesNoSidecarBeans() {
        runner.withPropertyValues("spring.ai.model.chat=openai", "spring.ai.model.embedding=openai").run(ctx ->
                assertThat(ctx).doesNotHaveBean(SidecarChatModel.class).doesNotHaveBean(SidecarEmbeddingModel.class)
                        .doesNotHaveBean(SidecarClient.class).doesNotHaveBean(SidecarHealthIndicator.class)
                        .doesNotHaveBean(SidecarProperties.class).doesNotHaveBean(SidecarAutoConfiguration.class));
    }

    @Test
    void eachModelFollowsItsOwnSelectionProperty() {
        // As with Spring AI's own starters, an unset property selects this starter's model.
        runner.withPropertyValues("spring.ai.model.chat=openai").run(ctx ->
                assertThat(ctx).doesNotHaveBean(SidecarChatModel.class).hasSingleBean(SidecarEmbeddingModel.class)
                        .hasSingleBean(SidecarClient.class).hasSingleBean(SidecarHealthIndicator.class));
        runner.withPropertyValues("spring.ai.model.chat=sidecar", "spring.ai.model.embedding=none").run(ctx ->
                assertThat(ctx).hasSingleBean(SidecarChatModel.class).doesNotHaveBean(SidecarEmbeddingModel.class)
                        .hasSingleBean(SidecarHealthIndicator.class));
    }

    @Test
    void userObservationConventionsAreUsed() {
        TestObservationRegistry registry = TestObservationRegistry.create();
        runner.withBean(ObservationRegistry.class, () -> registry)
                .withBean(ChatModelObservationConvention.class, () -> new DefaultChatModelObservationConvention() {
                    @Override
                    public String getName() {
                        return "my.chat";
                    }
                })
                .withBean(EmbeddingModelObservationConvention.class,
                        () -> new DefaultEmbeddingModelObservationConvention() {
                            @Override
                            public String getName() {
                                return "my.embedding";
                            }
                        })
                .run(ctx -> {
                    ctx.getBean(ChatModel.class).call("convention?");
                    ctx.getBean(EmbeddingModel.class).embed("vector?");
                });
        TestObservationRegistryAssert.assertThat(registry).hasObservationWithNameEqualTo("my.chat");
        TestObservationRegistryAssert.assertThat(registry).hasObservationWithNameEqualTo("my.embedding");
    }

    @Test
    void tokenUsageMeterComesFromSpringAisObservationAutoConfiguration() {
        SimpleMeterRegistry meters = new SimpleMeterRegistry();
        runner.withConfiguration(AutoConfigurations.of(ObservationAutoConfiguration.class,
                        ChatObservationAutoConfiguration.class, EmbeddingObservationAutoConfiguration.class))
                .withBean(MeterRegistry.class, () -> meters)
                .run(ctx -> {
                    assertThat(ctx).hasSingleBean(ChatModelMeterObservationHandler.class);
                    ctx.getBean(ChatModel.class).call("count my tokens");
                    ctx.getBean(EmbeddingModel.class).embed("and these");
                });
        assertThat(meters.find("gen_ai.client.token.usage").tag("gen_ai.token.type", "input")
                .tag("gen_ai.system", "sidecar").tag("gen_ai.operation.name", "chat").counter())
                .as("chat input tokens").isNotNull()
                .satisfies(c -> assertThat(c.count()).isEqualTo(12.0));
        assertThat(meters.find("gen_ai.client.token.usage").tag("gen_ai.token.type", "output")
                .tag("gen_ai.operation.name", "chat").counter().count()).isEqualTo(4.0);
        assertThat(meters.find("gen_ai.client.token.usage").tag("gen_ai.token.type", "input")
                .tag("gen_ai.operation.name", "embedding").counter().count()).isEqualTo(2.0);
    }

    @Test
    void healthIndicatorCanBeDisabledAndReportsOutOfService() {
        runner.withPropertyValues("management.health.sidecar.enabled=false")
                .run(ctx -> assertThat(ctx).doesNotHaveBean(SidecarHealthIndicator.class));
        sidecar.health.setStatus("sidecar.v1.Inference", ServingStatus.NOT_SERVING);
        runner.run(ctx -> assertThat(ctx.getBean(SidecarHealthIndicator.class).health().getStatus())
                .isEqualTo(Status.OUT_OF_SERVICE));
    }

    @Test
    void healthIsDownWhenTheSidecarIsGone() throws Exception {
        sidecar.close();
        runner.withPropertyValues("sidecar.client.max-retry-attempts=1").run(ctx ->
                assertThat(ctx.getBean(SidecarHealthIndicator.class).health().getStatus()).isEqualTo(Status.DOWN));
    }

    @Test
    void observationRegistryAddsTheGrpcObservationCustomizer() {
        runner.withBean(ObservationRegistry.class, ObservationRegistry::create).run(ctx -> {
            assertThat(ctx.getBeansOfType(SidecarClientCustomizer.class)).hasSize(2);
            assertThat(ctx.getBean(ChatModel.class).call("observed")).isEqualTo("echo: observed");
        });
        runner.run(ctx -> assertThat(ctx.getBeansOfType(SidecarClientCustomizer.class)).hasSize(1));
    }
}
