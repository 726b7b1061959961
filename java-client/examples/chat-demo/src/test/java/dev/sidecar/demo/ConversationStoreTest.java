package dev.sidecar.demo;

import static org.assertj.core.api.Assertions.assertThat;

import org.junit.jupiter.api.Test;
import org.springframework.ai.chat.messages.Message;

class ConversationStoreTest {

    @Test
    void keepsTheLatestTurnsPerSession() {
        ConversationStore store = new ConversationStore(new ChatDemoProperties("s", 10, 2, 100, new ChatDemoProperties.RateLimit(0, 1)));
        store.append("a", "u1", "a1");
        store.append("a", "u2", "a2");
        store.append("a", "u3", "a3");

        assertThat(store.turns("a")).isEqualTo(2);
        assertThat(store.history("a")).extracting(Message::getText).containsExactly("u2", "a2", "u3", "a3");
    }

    @Test
    void evictsTheLeastRecentlyUsedSession() {
        ConversationStore store = new ConversationStore(new ChatDemoProperties("s", 2, 5, 100, new ChatDemoProperties.RateLimit(0, 1)));
        store.append("a", "u", "x");
        store.append("b", "u", "x");
        store.history("a");  // touch a: b becomes the eldest
        store.append("c", "u", "x");

        assertThat(store.sessionCount()).isEqualTo(2);
        assertThat(store.turns("b")).isZero();
        assertThat(store.turns("a")).isEqualTo(1);
        assertThat(store.turns("c")).isEqualTo(1);
    }

    @Test
    void zeroTurnsKeepsNoHistory() {
        ConversationStore store = new ConversationStore(new ChatDemoProperties("s", 2, 0, 100, new ChatDemoProperties.RateLimit(0, 1)));
        store.append("a", "u", "x");
        assertThat(store.history("a")).isEmpty();
        assertThat(store.sessionCount()).isZero();
    }
}
