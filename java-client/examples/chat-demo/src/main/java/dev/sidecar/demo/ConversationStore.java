package dev.sidecar.demo;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.springframework.ai.chat.messages.AssistantMessage;
import org.springframework.ai.chat.messages.Message;
import org.springframework.ai.chat.messages.UserMessage;
import org.springframework.stereotype.Component;

/**
 * In-memory conversation history per session, bounded in both directions: at most
 * {@code maxSessions} sessions (least recently used evicted) and {@code maxTurns}
 * exchanges per session (oldest dropped first). Keeping history append-only between
 * trims means consecutive prompts of a session share a growing prefix, which the
 * sidecar's prefix cache reuses.
 */
@Component
public class ConversationStore {

    private final int maxTurns;
    private final Map<String, List<Message>> sessions;

    public ConversationStore(ChatDemoProperties props) {
        this.maxTurns = props.maxTurns();
        int maxSessions = props.maxSessions();
        this.sessions = new LinkedHashMap<>(16, 0.75f, true) {
            @Override
            protected boolean removeEldestEntry(Map.Entry<String, List<Message>> eldest) {
                return size() > maxSessions;
            }
        };
    }

    /** A copy of the session's history (empty for an unknown session). */
    public synchronized List<Message> history(String sessionId) {
        List<Message> h = sessions.get(sessionId);
        return h == null ? List.of() : List.copyOf(h);
    }

    /** Appends one completed exchange, dropping the oldest exchanges beyond the bound. */
    public synchronized void append(String sessionId, String user, String assistant) {
        List<Message> h = sessions.computeIfAbsent(sessionId, k -> new ArrayList<>());
        h.add(new UserMessage(user));
        h.add(new AssistantMessage(assistant));
        while (h.size() > 2 * maxTurns) {
            h.remove(0);
            h.remove(0);
        }
        if (h.isEmpty()) {
            sessions.remove(sessionId);
        }
    }

    /** Number of exchanges stored for the session. */
    public synchronized int turns(String sessionId) {
        List<Message> h = sessions.get(sessionId);
        return h == null ? 0 : h.size() / 2;
    }

    public synchronized boolean clear(String sessionId) {
        return sessions.remove(sessionId) != null;
    }

    public synchronized int sessionCount() {
        return sessions.size();
    }
}
