package dev.sidecar.it;

import static dev.sidecar.it.StaticResolver.local;
import static org.assertj.core.api.Assertions.assertThat;

import dev.sidecar.client.SessionAffinityLoadBalancerProvider;
import dev.sidecar.client.SidecarClient;
import dev.sidecar.spring.SidecarChatModel;
import dev.sidecar.spring.SidecarChatOptions;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.List;
import java.util.Set;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.springframework.ai.chat.client.ChatClient;
import org.springframework.ai.chat.messages.AssistantMessage;
import org.springframework.ai.chat.messages.Message;
import org.springframework.ai.chat.messages.SystemMessage;
import org.springframework.ai.chat.messages.UserMessage;
import org.springframework.ai.chat.metadata.Usage;
import org.springframework.ai.chat.model.ChatResponse;

/**
 * Two real sidecars behind one client with the {@code sidecar_session_affinity} load balancer: every turn of
 * a conversation carrying a session id ({@link SidecarChatOptions#getSessionId()}) lands on one replica, so
 * turn 2 finds turn 1's KV blocks in that replica's prefix cache and reports them as cached prompt tokens
 * (Spring AI's {@link Usage#getCacheReadInputTokens()}). Without a session id the calls are balanced
 * round-robin and turn 2 goes to the other replica, which has never seen turn 1.
 */
class SessionAffinityIT {

    private static final int BLOCK = 16;
    private static final int MAX_TOKENS = 8;

    private static SidecarProcess a;
    private static SidecarProcess b;
    private static StaticResolver resolver;
    private static SidecarClient client;
    private static ChatClient chat;

    @BeforeAll
    static void start() throws Exception {
        a = SidecarProcess.start(replica("replica-a"));
        b = SidecarProcess.start(replica("replica-b"));
        resolver = new StaticResolver(List.of(local(a), local(b)));
        client = SidecarClient.builder().target(resolver.target()).healthCheck(true)
                .loadBalancingPolicy(SessionAffinityLoadBalancerProvider.POLICY)
                .defaultDeadline(Duration.ofSeconds(60)).build();
        chat = ChatClient.create(SidecarChatModel.builder().client(client).build());
    }

    @AfterAll
    static void stop() throws Exception {
        for (AutoCloseable c : new AutoCloseable[] {client, resolver, a, b}) {
            if (c != null) {
                c.close();
            }
        }
    }

    private static String[] replica(String name) {
        return new String[] {"--num-kv-blocks", String.valueOf(ItArgs.NUM_KV_BLOCKS), "--block-size",
                String.valueOf(BLOCK), "--served-model-name", name};
    }

    /** A system prompt of its own per conversation (its first block differs), long enough to span blocks. */
    private static List<Message> opening(String conversation) {
        return new ArrayList<>(List.of(
                new SystemMessage(conversation + ": you are the support desk of a bicycle shop. Answer in one short "
                        + "sentence, name the part the customer should check first, and never invent prices."),
                new UserMessage("My rear brake squeaks when it rains. What should I look at?")));
    }

    private static ChatResponse turn(List<Message> history, String sessionId) {
        SidecarChatOptions.Builder options = SidecarChatOptions.builder().maxTokens(MAX_TOKENS).temperature(0.0);
        if (sessionId != null) {
            options.sessionId(sessionId);
        }
        ChatResponse r = chat.prompt().messages(history).options(options).call().chatResponse();
        assertThat(r).isNotNull();
        history.add(r.getResult().getOutput());
        return r;
    }

    private static long cached(ChatResponse r) {
        Long n = r.getMetadata().getUsage().getCacheReadInputTokens();
        assertThat(n).as("cache-read input tokens are reported").isNotNull();
        assertThat(((Number) r.getMetadata().get(SidecarChatModel.CACHED_TOKENS)).longValue()).isEqualTo(n);
        return n;
    }

    @Test
    void everyTurnOfASessionLandsOnOneReplicaAndTurnTwoReusesTurnOnesPromptFromItsCache() {
        Set<String> replicasUsed = new HashSet<>();
        // Sessions hash onto either replica; converse until both have held a session (a few tries at most).
        for (int i = 0; i < 16 && (replicasUsed.size() < 2 || i < 3); i++) {
            String session = "conversation-" + i;
            List<Message> history = opening(session);
            ChatResponse first = turn(history, session);
            int firstPrompt = first.getMetadata().getUsage().getPromptTokens();
            String replica = first.getMetadata().getModel();

            history.add(new UserMessage("It is a rim brake, the pads look fine. Anything else?"));
            ChatResponse second = turn(history, session);
            assertThat(second.getMetadata().getModel()).as("turn 2 of " + session).isEqualTo(replica);
            // Turn 1's prompt (all but its last partial block) is a prefix of turn 2's, held by this replica.
            assertThat(cached(second)).as("cached prompt tokens of turn 2 of " + session)
                    .isPositive().isGreaterThanOrEqualTo(firstPrompt - BLOCK + 1L);

            history.add(new UserMessage("Thanks. And the chain?"));
            int secondPrompt = second.getMetadata().getUsage().getPromptTokens();
            ChatResponse third = turn(history, session);
            assertThat(third.getMetadata().getModel()).as("turn 3 of " + session).isEqualTo(replica);
            assertThat(cached(third)).isGreaterThanOrEqualTo(secondPrompt - BLOCK + 1L);
            replicasUsed.add(replica);
        }
        assertThat(replicasUsed).containsExactlyInAnyOrder("replica-a", "replica-b");
    }

    @Test
    void aStreamedTurnOfASessionReusesTheEarlierTurnsToo() {
        String session = "streamed-conversation";
        List<Message> history = opening(session);
        ChatResponse first = turn(history, session);
        history.add(new UserMessage("It is a rim brake, the pads look fine. Anything else?"));
        List<ChatResponse> chunks = chat.prompt().messages(history)
                .options(SidecarChatOptions.builder().maxTokens(MAX_TOKENS).temperature(0.0).sessionId(session))
                .stream().chatResponse().collectList().block(Duration.ofSeconds(60));
        assertThat(chunks).isNotEmpty();
        ChatResponse last = chunks.get(chunks.size() - 1);
        assertThat(cached(last)).isGreaterThanOrEqualTo(first.getMetadata().getUsage().getPromptTokens() - BLOCK + 1L);
    }

    @Test
    void withoutASessionIdTheTurnsAreSpreadAndTurnTwoFindsNothingOfTurnOne() {
        Set<String> replicasUsed = new HashSet<>();
        int moved = 0;
        for (int i = 0; i < 4; i++) {
            List<Message> history = opening("unkeyed-conversation-" + i);
            ChatResponse first = turn(history, null);
            history.add(new UserMessage("It is a rim brake, the pads look fine. Anything else?"));
            ChatResponse second = turn(history, null);
            // Round-robin spreads the calls (its picker may restart at another replica when it is rebuilt, so
            // not every turn 2 moves); a turn 2 that moved finds nothing of turn 1 on the other replica.
            if (!second.getMetadata().getModel().equals(first.getMetadata().getModel())) {
                moved++;
                assertThat(cached(second)).as("turn 2 on the other replica")
                        .isLessThan(first.getMetadata().getUsage().getPromptTokens() - BLOCK + 1L);
            }
            replicasUsed.add(first.getMetadata().getModel());
            replicasUsed.add(second.getMetadata().getModel());
        }
        assertThat(moved).as("turns 2 that round-robin moved to the other replica").isPositive();
        assertThat(replicasUsed).containsExactlyInAnyOrder("replica-a", "replica-b");
    }
}
