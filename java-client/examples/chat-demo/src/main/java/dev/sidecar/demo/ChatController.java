package dev.sidecar.demo;

import dev.sidecar.demo.ChatApi.MessageReply;
import dev.sidecar.demo.ChatApi.MessageRequest;
import dev.sidecar.spring.SidecarProperties;
import jakarta.servlet.http.HttpServletResponse;
import java.time.Duration;
import java.util.HashMap;
import java.util.Map;
import org.springframework.http.MediaType;
import org.springframework.http.ResponseEntity;
import org.springframework.web.bind.annotation.DeleteMapping;
import org.springframework.web.bind.annotation.PostMapping;
import org.springframework.web.bind.annotation.RequestBody;
import org.springframework.web.bind.annotation.RequestHeader;
import org.springframework.web.bind.annotation.RequestMapping;
import org.springframework.web.bind.annotation.RestController;
import org.springframework.web.context.request.async.DeferredResult;
import org.springframework.web.servlet.mvc.method.annotation.SseEmitter;

/**
 * The chat API. A conversation is identified by the {@code X-Session-ID} header (a new
 * id is issued, and returned in the same header, when it is absent).
 */
@RestController
@RequestMapping("/api/chat")
public class ChatController {

    static final String SESSION_HEADER = "X-Session-ID";
    // The HTTP side of a stream outlives the sidecar call's deadline by this much, so the
    // deadline ends the stream first and the client gets an "error" event naming it.
    private static final Duration STREAM_TIMEOUT_MARGIN = Duration.ofSeconds(5);

    private final ChatService chat;
    private final Long streamTimeoutMs;

    public ChatController(ChatService chat, SidecarProperties sidecar) {
        this.chat = chat;
        // One source for every timeout of a stream: the sidecar stream deadline. Without one
        // the servlet container's async timeout (spring.mvc.async.request-timeout) applies.
        Duration deadline = sidecar.getStreamDeadline();
        this.streamTimeoutMs = deadline == null || deadline.isZero() ? null
                : deadline.plus(STREAM_TIMEOUT_MARGIN).toMillis();
    }

    /** One turn; answers {@link MessageReply} as JSON. */
    @PostMapping(path = "/message", consumes = MediaType.APPLICATION_JSON_VALUE,
            produces = MediaType.APPLICATION_JSON_VALUE)
    public ResponseEntity<MessageReply> message(@RequestHeader(name = SESSION_HEADER, required = false) String session,
                                                @RequestBody(required = false) MessageRequest body) {
        String sessionId = chat.sessionId(session);
        String message = chat.validMessage(body);
        MessageReply reply = chat.send(sessionId, message);
        return ResponseEntity.ok().header(SESSION_HEADER, sessionId).body(reply);
    }

    /**
     * One turn as server-sent events: {@code delta} events ({"text": ...}) and a final
     * {@code done} event with the finish reason and usage, or an {@code error} event if
     * the sidecar fails mid-stream.
     */
    @PostMapping(path = "/stream", consumes = MediaType.APPLICATION_JSON_VALUE,
            produces = MediaType.TEXT_EVENT_STREAM_VALUE)
    public DeferredResult<SseEmitter> stream(@RequestHeader(name = SESSION_HEADER, required = false) String session,
                                                @RequestBody(required = false) MessageRequest body,
                                                HttpServletResponse response) {
        String sessionId = chat.sessionId(session);
        // Set before anything is written, so it is on the 200 event stream and on error answers.
        response.setHeader(SESSION_HEADER, sessionId);
        String message = chat.validMessage(body);
        return SseRelay.relay(chat.stream(sessionId, message), streamTimeoutMs, last -> {
            Map<String, Object> done = new HashMap<>();
            done.put("sessionId", sessionId);
            done.put("finishReason", last == null || last.getResult() == null ? null
                    : last.getResult().getMetadata().getFinishReason());
            done.put("usage", ChatService.usage(last == null ? null : last.getMetadata()));
            done.put("turns", chat.turns(sessionId));
            return done;
        });
    }

    /** Forgets a session's history: 204, or 404 when unknown. */
    @DeleteMapping("/session")
    public ResponseEntity<Void> clear(@RequestHeader(SESSION_HEADER) String session) {
        return chat.clear(chat.sessionId(session)) ? ResponseEntity.noContent().build()
                : ResponseEntity.notFound().build();
    }
}
