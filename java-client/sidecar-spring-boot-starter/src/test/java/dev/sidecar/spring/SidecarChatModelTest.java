package dev.sidecar.spring;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import dev.sidecar.client.InvalidRequestException;
import dev.sidecar.client.ModelNotFoundException;
import dev.sidecar.client.RateLimitedException;
import dev.sidecar.client.SidecarUnavailableException;
import dev.sidecar.client.SidecarClient;
import dev.sidecar.v1.CacheControl;
import dev.sidecar.v1.ChatRequest;
import io.grpc.Status;
import io.micrometer.observation.Observation;
import io.micrometer.observation.ObservationHandler;
import io.micrometer.observation.tck.TestObservationRegistry;
import io.micrometer.observation.tck.TestObservationRegistryAssert;
import java.time.Duration;
import java.util.List;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import org.springframework.ai.chat.client.ChatClient;
import org.springframework.ai.chat.client.advisor.observation.AdvisorObservationContext;
import org.springframework.ai.chat.client.observation.ChatClientObservationContext;
import org.springframework.ai.chat.observation.ChatModelObservationContext;
import org.springframework.ai.retry.NonTransientAiException;
import org.springframework.ai.retry.TransientAiException;
import org.springframework.ai.chat.messages.AssistantMessage;
import org.springframework.ai.chat.messages.SystemMessage;
import org.springframework.ai.chat.messages.ToolResponseMessage;
import org.springframework.ai.chat.messages.UserMessage;
import org.springframework.ai.chat.model.ChatResponse;
import org.springframework.ai.chat.prompt.ChatOptions;
import org.springframework.ai.chat.prompt.Prompt;

class SidecarChatModelTest {

    private FakeSidecar sidecar;
    private SidecarClient client;
    private TestObservationRegistry observations;
    private final List<Observation.Context> stopped = new java.util.concurrent.CopyOnWriteArrayList<>();
    private SidecarChatModel model;

    @BeforeEach
    void setUp() throws Exception {
        sidecar = new FakeSidecar();
        client = SidecarClient.builder().channelBuilder(sidecar.channelBuilder()).build();
        observations = TestObservationRegistry.create();
        stopped.clear();
        observations.observationConfig().observationHandler(new ObservationHandler<Observation.Context>() {
            @Override
            public boolean supportsContext(Observation.Context context) {
                return true;
            }

            @Override
            public void onStop(Observation.Context context) {
                stopped.add(context);
            }
        });
        model = SidecarChatModel.builder()
                .client(client)
                .defaultOptions(SidecarChatOptions.builder().maxTokens(32).temperature(0.0).stop(List.of("\n\n")).build())
                .observationRegistry(observations)
                .build();
    }

    @AfterEach
    void tearDown() throws Exception {
        client.close();
        sidecar.close();
    }

    @Test
    void callMapsMessagesOptionsUsageFinishReasonAndCacheMetadata() {
        ChatResponse r = model.call(new Prompt(List.of(new SystemMessage("be brief"), new UserMessage("hi"),
                new AssistantMessage("hello"), new UserMessage("is this cached?"))));

        ChatRequest sent = sidecar.chats.peek();
        assertThat(sent.getMessagesList()).extracting("role").containsExactly("system", "user", "assistant", "user");
        assertThat(sent.getSampling().getMaxTokens()).isEqualTo(32);
        assertThat(sent.getSampling().hasTemperature()).isTrue();
        assertThat(sent.getSampling().hasTopP()).isFalse();
        assertThat(sent.getSampling().getStopList()).containsExactly("\n\n");

        assertThat(r.getResult().getOutput().getText()).isEqualTo("echo: is this cached?");
        assertThat(r.getResult().getMetadata().getFinishReason()).isEqualTo("STOP");
        assertThat(r.getMetadata().getUsage().getPromptTokens()).isEqualTo(12);
        assertThat(r.getMetadata().getUsage().getCompletionTokens()).isEqualTo(4);
        assertThat(r.getMetadata().getUsage().getTotalTokens()).isEqualTo(16);
        assertThat(r.getMetadata().getId()).isEqualTo("chat-1");
        assertThat(r.getMetadata().getModel()).isEqualTo("demo");
        assertThat((String) r.getMetadata().get(SidecarChatModel.CACHE_STATUS)).isEqualTo("HIT_SEMANTIC");
        assertThat((Double) r.getMetadata().get(SidecarChatModel.CACHE_SIMILARITY)).isCloseTo(0.93, org.assertj.core.data.Offset.offset(1e-6));
        assertThat((Integer) r.getMetadata().get(SidecarChatModel.CACHED_TOKENS)).isEqualTo(8);
        assertThat(r.getMetadata().getUsage().getCacheReadInputTokens()).isEqualTo(8L);
        assertThat((String) r.getResult().getMetadata().get(SidecarChatModel.CACHE_STATUS)).isEqualTo("HIT_SEMANTIC");
    }

    @Test
    void perCallOptionsOverrideDefaults() {
        model.call(new Prompt("a", SidecarChatOptions.builder().maxTokens(5).seed(7L)
                .cacheControl(CacheControl.CACHE_CONTROL_SKIP).priority(2).build()));
        ChatRequest first = sidecar.chats.poll();
        assertThat(first.getSampling().getMaxTokens()).isEqualTo(5);
        assertThat(first.getSampling().getSeed()).isEqualTo(7);
        assertThat(first.getSampling().getStopList()).containsExactly("\n\n");
        assertThat(first.getCacheControl()).isEqualTo(CacheControl.CACHE_CONTROL_SKIP);
        assertThat(first.getPriority()).isEqualTo(2);

        // Generic Spring AI options work too.
        model.call(new Prompt("b", ChatOptions.builder().topP(0.5).maxTokens(9).build()));
        ChatRequest second = sidecar.chats.poll();
        assertThat(second.getSampling().getTopP()).isEqualTo(0.5f);
        assertThat(second.getSampling().getMaxTokens()).isEqualTo(9);
        assertThat(second.getSampling().hasSeed()).isFalse();
    }

    @Test
    void beamWidthIsSentAsTheSamplingField() {
        model.call(new Prompt("beams", SidecarChatOptions.builder().beamWidth(4).maxTokens(6).build()));
        ChatRequest sent = sidecar.chats.poll();
        assertThat(sent.getSampling().hasBeamWidth()).isTrue();
        assertThat(sent.getSampling().getBeamWidth()).isEqualTo(4);
        assertThat(sent.getSampling().getMaxTokens()).isEqualTo(6);
        SidecarChatOptions o = SidecarChatOptions.builder().beamWidth(3).build();
        assertThat(o.mutate().build()).isEqualTo(o);
        assertThat(SidecarChatOptions.merge(o, ChatOptions.builder().maxTokens(2).build()).getBeamWidth()).isEqualTo(3);

        model.call(new Prompt("no beams"));
        assertThat(sidecar.chats.poll().getSampling().hasBeamWidth()).isFalse();
    }

    @Test
    void chatClientOptionsBuilderCarriesTheSidecarFields() {
        ChatClient.create(model).prompt().user("opts")
                .options(SidecarChatOptions.builder().seed(7L).cacheControl(CacheControl.CACHE_CONTROL_REFRESH)
                        .maxTokens(3))
                .call().content();
        ChatRequest sent = sidecar.chats.poll();
        assertThat(sent.getSampling().getSeed()).isEqualTo(7);
        assertThat(sent.getSampling().getMaxTokens()).isEqualTo(3);
        assertThat(sent.getCacheControl()).isEqualTo(CacheControl.CACHE_CONTROL_REFRESH);
        // the model's defaults still apply where the call set nothing
        assertThat(sent.getSampling().getStopList()).containsExactly("\n\n");

        SidecarChatOptions o = SidecarChatOptions.builder().seed(1L).timeout(Duration.ofSeconds(3)).build();
        assertThat(o.mutate().build()).isEqualTo(o);
        assertThat(SidecarChatOptions.builder().seed(2L).combineWith(o.mutate()).build().getTimeout())
                .isEqualTo(Duration.ofSeconds(3));
    }

    @Test
    void streamEmitsDeltasAndFinishesWithUsage() {
        List<ChatResponse> chunks = model.stream(new Prompt("stream me")).collectList().block(Duration.ofSeconds(5));

        assertThat(chunks).extracting(c -> c.getResult().getOutput().getText())
                .containsExactly("echo:", " ", "stream me");
        ChatResponse last = chunks.get(2);
        assertThat(last.getResult().getMetadata().getFinishReason()).isEqualTo("LENGTH");
        assertThat(last.getMetadata().getUsage().getCompletionTokens()).isEqualTo(3);
        assertThat(chunks.get(1).getResult().getMetadata().getFinishReason()).isNull();
        assertThat((String) chunks.get(0).getMetadata().get(SidecarChatModel.CACHE_STATUS)).isEqualTo("MISS");
    }

    @Test
    void chatClientCallAndStreamContent() {
        ChatClient chatClient = ChatClient.create(model);

        String content = chatClient.prompt().system("You are terse.").user("ping").call().content();
        assertThat(content).isEqualTo("echo: ping");
        assertThat(sidecar.chats.poll().getMessagesList()).extracting("role").containsExactly("system", "user");

        List<String> streamed = chatClient.prompt().user("pong").stream().content().collectList()
                .block(Duration.ofSeconds(5));
        assertThat(String.join("", streamed)).isEqualTo("echo: pong");
    }

    @Test
    void transientErrorsAreTransientAiExceptionsWithTheTypedCauseAndAreObserved() {
        sidecar.failWith = Status.RESOURCE_EXHAUSTED.withDescription("rate limit exceeded");

        assertThatThrownBy(() -> model.call(new Prompt("x"))).isInstanceOf(TransientAiException.class)
                .hasCauseInstanceOf(RateLimitedException.class).hasMessageContaining("rate limit exceeded");
        assertThatThrownBy(() -> model.stream(new Prompt("x")).blockLast(Duration.ofSeconds(5)))
                .isInstanceOf(TransientAiException.class).hasCauseInstanceOf(RateLimitedException.class);
        TestObservationRegistryAssert.assertThat(observations).hasNumberOfObservationsEqualTo(2)
                .forAllObservationsWithNameEqualTo("gen_ai.client.operation", o -> o.assertThatError()
                        .isInstanceOf(TransientAiException.class));
    }

    @Test
    void badInputAndUnknownModelsAreNonTransient() {
        sidecar.failWith = Status.INVALID_ARGUMENT.withDescription("sampling.temperature: must be >= 0");
        assertThatThrownBy(() -> model.call(new Prompt("x"))).isInstanceOf(NonTransientAiException.class)
                .hasCauseInstanceOf(InvalidRequestException.class).hasMessageContaining("sampling.temperature");

        sidecar.failWith = Status.NOT_FOUND.withDescription("model: unknown model 'gpt-4'; this sidecar serves 'demo'");
        assertThatThrownBy(() -> model.stream(new Prompt("x")).blockLast(Duration.ofSeconds(5)))
                .isInstanceOf(NonTransientAiException.class).hasCauseInstanceOf(ModelNotFoundException.class);

        sidecar.failWith = Status.UNAVAILABLE.withDescription("draining");
        try (SidecarClient noRetry = SidecarClient.builder().channelBuilder(sidecar.channelBuilder())
                .maxRetryAttempts(1).build()) {
            assertThatThrownBy(() -> SidecarChatModel.builder().client(noRetry).build().call(new Prompt("x")))
                    .isInstanceOf(TransientAiException.class).hasCauseInstanceOf(SidecarUnavailableException.class);
        }
    }

    @Test
    void timeoutOptionIsTheCallsDeadline() {
        try (SidecarClient c = SidecarClient.builder().channelBuilder(sidecar.channelBuilder())
                .defaultDeadline(Duration.ofSeconds(20)).defaultStreamDeadline(Duration.ofSeconds(40)).build()) {
            SidecarChatModel m = SidecarChatModel.builder().client(c).build();
            m.call(new Prompt("a"));
            assertThat(lastDeadlineSeconds()).isBetween(1L, 20L);
            m.stream(new Prompt("b")).blockLast(Duration.ofSeconds(5));
            assertThat(lastDeadlineSeconds()).isBetween(21L, 40L);
            m.call(new Prompt("c", SidecarChatOptions.builder().timeout(Duration.ofSeconds(300)).build()));
            assertThat(lastDeadlineSeconds()).isBetween(41L, 300L);
            m.stream(new Prompt("d", SidecarChatOptions.builder().timeout(Duration.ofSeconds(200)).build()))
                    .blockLast(Duration.ofSeconds(5));
            assertThat(lastDeadlineSeconds()).isBetween(41L, 200L);
        }
    }

    private long lastDeadlineSeconds() {
        io.grpc.Deadline d = null;
        for (var o : sidecar.deadlines) {
            d = o.orElse(null);
        }
        assertThat(d).as("the call had a deadline").isNotNull();
        return d.timeRemaining(java.util.concurrent.TimeUnit.SECONDS);
    }

    @Test
    void streamObservationIsAChildOfTheChatClientObservationAndRecordsTheWholeAnswer() {
        ChatClient chatClient = ChatClient.create(model, observations);

        List<String> streamed = chatClient.prompt().user("aggregate me").stream().content().collectList()
                .block(Duration.ofSeconds(5));
        assertThat(String.join("", streamed)).isEqualTo("echo: aggregate me");

        ChatModelObservationContext modelContext = stopped.stream().filter(ChatModelObservationContext.class::isInstance)
                .map(ChatModelObservationContext.class::cast).findFirst().orElseThrow();
        assertThat(modelContext.isStreaming()).isTrue();
        // Parent: ChatClient's innermost advisor observation, itself under the ChatClient observation.
        assertThat(modelContext.getParentObservation()).as("parent observation").isNotNull();
        assertThat(modelContext.getParentObservation().getContextView()).isInstanceOf(AdvisorObservationContext.class);
        assertThat(ancestors(modelContext)).hasAtLeastOneElementOfType(ChatClientObservationContext.class);
        ChatResponse recorded = modelContext.getResponse();
        assertThat(recorded.getResult().getOutput().getText()).isEqualTo("echo: aggregate me");
        assertThat(recorded.getResult().getMetadata().getFinishReason()).isEqualTo("LENGTH");
        assertThat(recorded.getMetadata().getUsage().getCompletionTokens()).isEqualTo(3);
        TestObservationRegistryAssert.assertThat(observations)
                .hasObservationWithNameEqualTo("gen_ai.client.operation").that()
                .hasBeenStarted().hasBeenStopped()
                .hasHighCardinalityKeyValue("gen_ai.usage.output_tokens", "3");
    }

    @Test
    void grpcCallObservationsAreChildrenOfTheChatModelObservation() {
        try (SidecarClient observed = SidecarClient.builder().channelBuilder(sidecar.channelBuilder())
                .interceptor(new io.micrometer.core.instrument.binder.grpc.ObservationGrpcClientInterceptor(
                        observations)).build()) {
            SidecarChatModel m = SidecarChatModel.builder().client(observed).observationRegistry(observations).build();
            m.call(new Prompt("unary"));
            m.stream(new Prompt("streamed")).blockLast(Duration.ofSeconds(5));
        }
        List<Observation.Context> grpc = stopped.stream()
                .filter(io.micrometer.core.instrument.binder.grpc.GrpcClientObservationContext.class::isInstance)
                .toList();
        assertThat(grpc).hasSize(2).allSatisfy(c -> assertThat(c.getParentObservation()).isNotNull()
                .extracting(p -> p.getContextView()).isInstanceOf(ChatModelObservationContext.class));
    }

    @Test
    void blockingCallObservationIsAChildOfTheChatClientObservation() {
        ChatClient.create(model, observations).prompt().user("parent?").call().content();

        ChatModelObservationContext modelContext = stopped.stream().filter(ChatModelObservationContext.class::isInstance)
                .map(ChatModelObservationContext.class::cast).findFirst().orElseThrow();
        assertThat(modelContext.isStreaming()).isFalse();
        assertThat(modelContext.getParentObservation().getContextView()).isInstanceOf(AdvisorObservationContext.class);
        assertThat(ancestors(modelContext)).hasAtLeastOneElementOfType(ChatClientObservationContext.class);
        assertThat(modelContext.getResponse().getResult().getOutput().getText()).isEqualTo("echo: parent?");
    }

    private static List<Object> ancestors(Observation.ContextView context) {
        List<Object> out = new java.util.ArrayList<>();
        for (var p = context.getParentObservation(); p != null; p = p.getContextView().getParentObservation()) {
            out.add(p.getContextView());
        }
        return out;
    }

    @Test
    void cancelledStreamStopsItsObservationOnce() {
        model.stream(new Prompt("partial answer")).take(2).blockLast(Duration.ofSeconds(5));

        // Only a completed stream has a whole answer to record (MessageAggregator); a cancelled one
        // still ends its observation, exactly once.
        assertThat(stopped.stream().filter(ChatModelObservationContext.class::isInstance).count()).isEqualTo(1);
        TestObservationRegistryAssert.assertThat(observations)
                .hasObservationWithNameEqualTo("gen_ai.client.operation").that().hasBeenStopped();
    }

    @Test
    void callsAreObservedWithSpringAiChatConventions() {
        model.call(new Prompt("observe"));
        model.stream(new Prompt("observe stream")).blockLast(Duration.ofSeconds(5));

        TestObservationRegistryAssert.assertThat(observations)
                .hasNumberOfObservationsEqualTo(2)
                .hasAnObservation(o -> o.hasLowCardinalityKeyValue("gen_ai.system", "sidecar")
                        .hasHighCardinalityKeyValue("gen_ai.usage.input_tokens", "12"));
    }

    @Test
    void emptyToolMessagesAreRejectedNamingTheField() {
        Prompt prompt = new Prompt(List.of(new UserMessage("q"),
                ToolResponseMessage.builder().responses(List.of()).build()));
        assertThatThrownBy(() -> model.call(prompt)).isInstanceOf(IllegalArgumentException.class)
                .hasMessageContaining("prompt.messages[1]");
        assertThat(sidecar.chats).isEmpty();
    }
}
