package dev.sidecar.spring;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import dev.sidecar.client.SidecarClient;
import dev.sidecar.v1.ChatMessage;
import dev.sidecar.v1.ChatRequest;
import dev.sidecar.v1.Completion;
import dev.sidecar.v1.CompletionChunk;
import dev.sidecar.v1.FinishReason;
import dev.sidecar.v1.ResponseFormat;
import dev.sidecar.v1.ToolCall;
import dev.sidecar.v1.ToolChoice;
import dev.sidecar.v1.Usage;
import io.micrometer.observation.ObservationRegistry;
import java.time.Duration;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CopyOnWriteArrayList;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import org.springframework.ai.chat.client.AdvisorParams;
import org.springframework.ai.chat.client.ChatClient;
import org.springframework.ai.chat.messages.AssistantMessage;
import org.springframework.ai.chat.messages.ToolResponseMessage;
import org.springframework.ai.chat.messages.UserMessage;
import org.springframework.ai.chat.model.ChatResponse;
import org.springframework.ai.chat.prompt.ChatOptions;
import org.springframework.ai.chat.prompt.Prompt;
import org.springframework.ai.content.Media;
import org.springframework.ai.model.tool.StructuredOutputChatOptions;
import org.springframework.ai.model.tool.ToolCallingChatOptions;
import org.springframework.ai.support.ToolCallbacks;
import org.springframework.ai.tool.ToolCallback;
import org.springframework.ai.tool.annotation.Tool;
import org.springframework.ai.tool.annotation.ToolParam;
import org.springframework.util.MimeTypeUtils;

/** Tools and structured output through SidecarChatModel, against the in-process fake sidecar. */
class SidecarToolCallingTest {

    /** Tools as an application writes them; records each invocation. */
    static final class WeatherTools {
        final List<String> calls = new CopyOnWriteArrayList<>();

        @Tool(description = "Current temperature in a city, in Celsius")
        String currentWeather(@ToolParam(description = "the city") String city) {
            calls.add(city);
            return "21 C in " + city;
        }
    }

    static final class DirectTools {
        @Tool(description = "Order status", returnDirect = true)
        String orderStatus(int order) {
            return "order " + order + " shipped";
        }
    }

    record Weather(String city, int celsius) {
    }

    private FakeSidecar sidecar;
    private SidecarClient client;
    private SidecarChatModel model;

    @BeforeEach
    void setUp() throws Exception {
        sidecar = new FakeSidecar();
        client = SidecarClient.builder().channelBuilder(sidecar.channelBuilder()).build();
        model = SidecarChatModel.builder()
                .client(client)
                .defaultOptions(SidecarChatOptions.builder().temperature(0.0).build())
                .observationRegistry(ObservationRegistry.NOOP)
                .build();
    }

    @AfterEach
    void tearDown() throws Exception {
        client.close();
        sidecar.close();
    }

    private static ToolCall call(String id, String name, String args) {
        return ToolCall.newBuilder().setId(id).setType("function").setName(name).setArguments(args).build();
    }

    private static Completion toolReply(ToolCall... calls) {
        return Completion.newBuilder().setRequestId("r1").addAllToolCalls(List.of(calls))
                .setFinishReason(FinishReason.FINISH_REASON_TOOL_CALLS)
                .setUsage(Usage.newBuilder().setPromptTokens(30).setCompletionTokens(12)).build();
    }

    private static Completion textReply(String text) {
        return Completion.newBuilder().setRequestId("r2").setText(text).setFinishReason(FinishReason.FINISH_REASON_STOP)
                .setUsage(Usage.newBuilder().setPromptTokens(50).setCompletionTokens(5)).build();
    }

    @Test
    void optionsCopyMergeAndCombineCarryToolsChoiceAndFormat() {
        ToolCallback[] weather = ToolCallbacks.from(new WeatherTools());
        ToolCallback[] direct = ToolCallbacks.from(new DirectTools());
        ResponseFormat regex = ResponseFormat.newBuilder().setType(ResponseFormat.Type.TYPE_REGEX).setRegex("[0-9]+")
                .build();
        SidecarChatOptions base = SidecarChatOptions.builder().toolCallbacks(weather).toolContext("tenant", "a")
                .toolContext("user", "u1").toolChoiceRequired().parallelToolCalls(false).responseFormat(regex)
                .maxTokens(9).build();

        assertThat(base.copy()).isEqualTo(base).isNotSameAs(base);
        assertThat(base.mutate().build().getToolChoice().getMode()).isEqualTo(ToolChoice.Mode.MODE_REQUIRED);
        assertThat(base.getToolCallbacks()).containsExactly(weather);

        // A call's own tools replace the defaults; tool contexts merge, the call's value winning.
        SidecarChatOptions merged = SidecarChatOptions.merge(base, SidecarChatOptions.builder().toolCallbacks(direct)
                .toolContext("tenant", "b").toolChoiceFunction("orderStatus").build());
        assertThat(merged.getToolCallbacks()).containsExactly(direct);
        assertThat(merged.getToolContext()).containsExactlyInAnyOrderEntriesOf(Map.of("tenant", "b", "user", "u1"));
        assertThat(merged.getToolChoice().getFunctionName()).isEqualTo("orderStatus");
        assertThat(merged.getParallelToolCalls()).isFalse();
        assertThat(merged.getResponseFormat()).isEqualTo(regex);
        assertThat(merged.getMaxTokens()).isEqualTo(9);
        // No tools in the call: the defaults stay.
        assertThat(SidecarChatOptions.merge(base, ChatOptions.builder().topK(3).build()).getToolCallbacks())
                .containsExactly(weather);

        // Spring AI's generic tool-calling and structured-output options are honoured too.
        SidecarChatOptions fromGeneric = SidecarChatOptions.merge(null,
                ToolCallingChatOptions.builder().toolCallbacks(direct).toolContext("k", "v").build());
        assertThat(fromGeneric.getToolCallbacks()).containsExactly(direct);
        assertThat(fromGeneric.getToolContext()).containsEntry("k", "v");
        SidecarChatOptions.Builder combined = SidecarChatOptions.builder().seed(3L)
                .combineWith(StructuredOutputChatOptions.builder().outputSchema("{\"type\":\"object\"}"))
                .combineWith(ToolCallingChatOptions.builder().toolCallbacks(weather));
        SidecarChatOptions c = combined.build();
        assertThat(c.getOutputSchema()).isEqualTo("{\"type\":\"object\"}");
        assertThat(c.getToolCallbacks()).containsExactly(weather);
        assertThat(c.getSeed()).isEqualTo(3L);

        // A cloned builder is independent of the original.
        SidecarChatOptions.Builder original = SidecarChatOptions.builder().toolContext("a", 1);
        SidecarChatOptions.Builder clone = original.clone().toolContext("b", 2);
        assertThat(original.build().getToolContext()).containsOnlyKeys("a");
        assertThat(clone.build().getToolContext()).containsOnlyKeys("a", "b");

        assertThatThrownBy(() -> SidecarChatOptions.builder().toolCallbacks(weather[0], weather[0]).build())
                .isInstanceOf(IllegalStateException.class).hasMessageContaining("currentWeather");
    }

    @Test
    void chatClientToolsAreSentExecutedAndAnsweredInTheSecondTurn() {
        WeatherTools tools = new WeatherTools();
        sidecar.replies.add(toolReply(call("call_1", "currentWeather", "{\"city\": \"Oslo\"}")));
        sidecar.replies.add(textReply("It is 21 C in Oslo."));

        String answer = ChatClient.create(model).prompt().user("Weather in Oslo?").tools(tools)
                .options(SidecarChatOptions.builder().toolChoiceFunction("currentWeather").parallelToolCalls(false))
                .call().content();

        assertThat(answer).isEqualTo("It is 21 C in Oslo.");
        assertThat(tools.calls).containsExactly("Oslo");
        ChatRequest first = sidecar.chats.poll();
        assertThat(first.getToolsList()).hasSize(1);
        dev.sidecar.v1.Tool sent = first.getTools(0);
        assertThat(sent.getName()).isEqualTo("currentWeather");
        assertThat(sent.getDescription()).isEqualTo("Current temperature in a city, in Celsius");
        assertThat(sent.getParameters()).contains("\"city\"").contains("\"type\"");
        assertThat(first.getToolChoice().getMode()).isEqualTo(ToolChoice.Mode.MODE_FUNCTION);
        assertThat(first.getToolChoice().getFunctionName()).isEqualTo("currentWeather");
        assertThat(first.getParallelToolCalls()).isFalse();
        // unset max tokens stays unset: the sidecar then allows the rest of the context
        assertThat(first.getSampling().hasMaxTokens()).isFalse();

        ChatRequest second = sidecar.chats.poll();
        assertThat(second.getMessagesList()).extracting(ChatMessage::getRole)
                .containsExactly("user", "assistant", "tool");
        ChatMessage assistant = second.getMessages(1);
        assertThat(assistant.getToolCallsList()).singleElement().satisfies(c -> {
            assertThat(c.getId()).isEqualTo("call_1");
            assertThat(c.getName()).isEqualTo("currentWeather");
            assertThat(c.getType()).isEqualTo("function");
            assertThat(c.getArguments()).isEqualTo("{\"city\": \"Oslo\"}");
        });
        ChatMessage tool = second.getMessages(2);
        assertThat(tool.getToolCallId()).isEqualTo("call_1");
        assertThat(tool.getName()).isEqualTo("currentWeather");
        assertThat(tool.getContent()).isEqualTo("21 C in Oslo");
        assertThat(second.getToolsList()).extracting(dev.sidecar.v1.Tool::getName).containsExactly("currentWeather");
        // the forced choice made the call; the turn with its result may answer in text
        assertThat(second.getToolChoice().getMode()).isEqualTo(ToolChoice.Mode.MODE_AUTO);
        assertThat(sidecar.chats).isEmpty();
    }

    @Test
    void callReturnsTheModelsToolCallsWithFinishReasonToolCalls() {
        sidecar.replies.add(toolReply(call("c1", "currentWeather", "{\"city\":\"Rome\"}"),
                call("c2", "currentWeather", "{\"city\":\"Paris\"}")));
        ChatResponse r = model.call(new Prompt("weather?", SidecarChatOptions.builder()
                .toolCallbacks(ToolCallbacks.from(new WeatherTools())).build()));

        assertThat(r.hasToolCalls()).isTrue();
        assertThat(r.getResult().getMetadata().getFinishReason()).isEqualTo("TOOL_CALLS");
        assertThat(r.getResult().getOutput().getToolCalls()).containsExactly(
                new AssistantMessage.ToolCall("c1", "function", "currentWeather", "{\"city\":\"Rome\"}"),
                new AssistantMessage.ToolCall("c2", "function", "currentWeather", "{\"city\":\"Paris\"}"));
    }

    @Test
    void returnDirectToolResultIsTheAnswerWithoutASecondTurn() {
        sidecar.replies.add(toolReply(call("c9", "orderStatus", "{\"order\": 17}")));

        String answer = ChatClient.create(model).prompt().user("Where is order 17?").tools(new DirectTools())
                .call().content();

        assertThat(answer).isEqualTo("\"order 17 shipped\"");
        assertThat(sidecar.chats).hasSize(1);
    }

    @Test
    void toolResponsesBecomeOneToolMessageEach() {
        AssistantMessage calls = AssistantMessage.builder().content("")
                .toolCalls(List.of(new AssistantMessage.ToolCall("a", "function", "currentWeather", "{\"city\":\"A\"}"),
                        new AssistantMessage.ToolCall("b", "function", "currentWeather", "{\"city\":\"B\"}")))
                .build();
        ToolResponseMessage results = ToolResponseMessage.builder().responses(List.of(
                new ToolResponseMessage.ToolResponse("a", "currentWeather", "1"),
                new ToolResponseMessage.ToolResponse("b", "currentWeather", "2"))).build();
        model.call(new Prompt(List.of(new UserMessage("q"), calls, results)));

        ChatRequest sent = sidecar.chats.poll();
        assertThat(sent.getMessagesList()).extracting(ChatMessage::getRole)
                .containsExactly("user", "assistant", "tool", "tool");
        assertThat(sent.getMessages(1).getToolCallsList()).extracting(ToolCall::getId, ToolCall::getIndex)
                .containsExactly(org.assertj.core.groups.Tuple.tuple("a", 0), org.assertj.core.groups.Tuple.tuple("b", 1));
        assertThat(sent.getMessagesList().subList(2, 4)).extracting(ChatMessage::getToolCallId, ChatMessage::getContent)
                .containsExactly(org.assertj.core.groups.Tuple.tuple("a", "1"), org.assertj.core.groups.Tuple.tuple("b", "2"));
    }

    @Test
    void streamedToolCallsAreExecutedAndTheAnswerStreamed() {
        WeatherTools tools = new WeatherTools();
        sidecar.streamReplies.add(List.of(
                CompletionChunk.newBuilder().setRequestId("s1").setDelta("").build(),
                CompletionChunk.newBuilder().setRequestId("s1").addToolCalls(call("s_1", "currentWeather",
                        "{\"city\": \"Lima\"}")).setFinishReason(FinishReason.FINISH_REASON_TOOL_CALLS)
                        .setUsage(Usage.newBuilder().setPromptTokens(20).setCompletionTokens(9)).build()));
        sidecar.streamReplies.add(List.of(
                CompletionChunk.newBuilder().setRequestId("s2").setDelta("Lima: ").build(),
                CompletionChunk.newBuilder().setRequestId("s2").setDelta("21 C").setFinishReason(
                        FinishReason.FINISH_REASON_STOP).build()));

        List<String> parts = ChatClient.create(model).prompt().user("Weather in Lima?").tools(tools).stream()
                .content().collectList().block(Duration.ofSeconds(10));

        assertThat(String.join("", parts)).isEqualTo("Lima: 21 C");
        assertThat(tools.calls).containsExactly("Lima");
        assertThat(sidecar.chats).hasSize(2);
        ChatRequest second = sidecar.chats.toArray(new ChatRequest[0])[1];
        assertThat(second.getMessagesList()).extracting(ChatMessage::getRole)
                .containsExactly("user", "assistant", "tool");
        assertThat(second.getMessages(2).getToolCallId()).isEqualTo("s_1");
    }

    @Test
    void bareStreamCarriesTheCallsWholeInTheirChunk() {
        sidecar.streamReplies.add(List.of(
                CompletionChunk.newBuilder().setRequestId("s1").setDelta("").build(),
                CompletionChunk.newBuilder().setRequestId("s1").addToolCalls(call("x", "currentWeather", "{}"))
                        .setFinishReason(FinishReason.FINISH_REASON_TOOL_CALLS).build()));
        List<ChatResponse> chunks = model.stream(new Prompt("q", SidecarChatOptions.builder()
                .toolCallbacks(ToolCallbacks.from(new WeatherTools())).build())).collectList()
                .block(Duration.ofSeconds(5));
        assertThat(chunks.get(0).hasToolCalls()).isFalse();
        assertThat(chunks.get(1).getResult().getOutput().getToolCalls()).extracting(AssistantMessage.ToolCall::id)
                .containsExactly("x");
        assertThat(chunks.get(1).getResult().getMetadata().getFinishReason()).isEqualTo("TOOL_CALLS");
    }

    @Test
    void nativeStructuredOutputSendsTheSchemaAndEntityParsesTheReply() {
        sidecar.replies.add(textReply("{\"city\": \"Oslo\", \"celsius\": 21}"));

        Weather w = ChatClient.create(model).prompt().user("Weather in Oslo as JSON")
                .advisors(AdvisorParams.ENABLE_NATIVE_STRUCTURED_OUTPUT).call().entity(Weather.class);

        assertThat(w).isEqualTo(new Weather("Oslo", 21));
        ChatRequest sent = sidecar.chats.poll();
        assertThat(sent.getResponseFormat().getType()).isEqualTo(ResponseFormat.Type.TYPE_JSON_SCHEMA);
        assertThat(sent.getResponseFormat().getJsonSchema()).contains("\"city\"").contains("\"celsius\"");
        // the schema travels as a constraint, not as instructions appended to the question
        assertThat(sent.getMessages(0).getContent()).isEqualTo("Weather in Oslo as JSON");
        assertThat(sent.getSampling().hasMaxTokens()).isFalse();
    }

    @Test
    void explicitResponseFormatIsSentAndConflictsWithAnOutputSchema() {
        ResponseFormat choice = ResponseFormat.newBuilder().setType(ResponseFormat.Type.TYPE_CHOICE)
                .addChoices("yes").addChoices("no").build();
        model.call(new Prompt("ok?", SidecarChatOptions.builder().responseFormat(choice).build()));
        assertThat(sidecar.chats.poll().getResponseFormat()).isEqualTo(choice);

        assertThatThrownBy(() -> model.call(new Prompt("ok?", SidecarChatOptions.builder().responseFormat(choice)
                .outputSchema("{\"type\":\"object\"}").build())))
                .isInstanceOf(IllegalArgumentException.class).hasMessageContaining("options.responseFormat")
                .hasMessageContaining("options.outputSchema");
        assertThat(sidecar.chats).isEmpty();
    }

    @Test
    void mediaIsRejectedNamingTheField() {
        UserMessage withImage = UserMessage.builder().text("what is this?")
                .media(new Media(MimeTypeUtils.IMAGE_PNG, new org.springframework.core.io.ByteArrayResource(new byte[] {1, 2, 3}))).build();
        assertThatThrownBy(() -> model.call(new Prompt(List.of(withImage))))
                .isInstanceOf(IllegalArgumentException.class).hasMessageContaining("prompt.messages[0].media")
                .hasMessageContaining("image/png");
        assertThatThrownBy(() -> model.stream(new Prompt(List.of(new UserMessage("hi"), withImage))).blockLast())
                .isInstanceOf(IllegalArgumentException.class).hasMessageContaining("prompt.messages[1].media");
        assertThat(sidecar.chats).isEmpty();
    }
}
