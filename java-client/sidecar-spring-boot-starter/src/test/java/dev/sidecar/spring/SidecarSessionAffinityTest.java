package dev.sidecar.spring;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import dev.sidecar.client.SessionAffinity;
import dev.sidecar.client.SidecarClient;
import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ClientCall;
import io.grpc.ClientInterceptor;
import io.grpc.MethodDescriptor;
import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import org.springframework.ai.chat.client.ChatClient;

/** SidecarChatOptions.sessionId reaches each gRPC call as its affinity key, for calls and streams. */
class SidecarSessionAffinityTest {

    private final List<String> keys = new CopyOnWriteArrayList<>();
    private FakeSidecar sidecar;
    private SidecarClient client;
    private SidecarChatModel model;

    @BeforeEach
    void setUp() throws Exception {
        sidecar = new FakeSidecar();
        ClientInterceptor recorder = new ClientInterceptor() {
            @Override
            public <Q, R> ClientCall<Q, R> interceptCall(MethodDescriptor<Q, R> method, CallOptions options,
                                                         Channel next) {
                keys.add(String.valueOf(options.getOption(SessionAffinity.CALL_OPTION)));
                return next.newCall(method, options);
            }
        };
        client = SidecarClient.builder().channelBuilder(sidecar.channelBuilder()).interceptor(recorder).build();
        model = SidecarChatModel.builder().client(client).build();
    }

    @AfterEach
    void tearDown() throws Exception {
        client.close();
        sidecar.close();
    }

    @Test
    void theSessionIdIsTheCallsAffinityKey() {
        ChatClient chat = ChatClient.create(model);
        chat.prompt().user("turn 1").options(SidecarChatOptions.builder().sessionId("s-42")).call().content();
        chat.prompt().user("turn 2").options(SidecarChatOptions.builder().sessionId("s-42")).stream().content()
                .collectList().block();
        chat.prompt().user("no session").call().content();
        assertThat(keys).containsExactly("s-42", "s-42", "null");
    }

    @Test
    void theSessionIdSurvivesMergingAndABlankOneIsRefused() {
        SidecarChatOptions o = SidecarChatOptions.builder().sessionId("s-1").build();
        assertThat(SidecarChatOptions.merge(SidecarChatOptions.builder().seed(1L).build(), o).getSessionId())
                .isEqualTo("s-1");
        assertThat(o.copy()).isEqualTo(o);
        assertThatThrownBy(() -> SidecarChatOptions.builder().sessionId(" "))
                .isInstanceOf(IllegalArgumentException.class).hasMessageContaining("sessionId");
    }
}
