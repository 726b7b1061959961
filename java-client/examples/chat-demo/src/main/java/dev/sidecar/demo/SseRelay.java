package dev.sidecar.demo;

import java.io.IOException;
import java.util.Map;
import java.util.function.Function;
import org.reactivestreams.Subscription;
import org.springframework.ai.chat.model.ChatResponse;
import org.springframework.http.MediaType;
import org.springframework.web.context.request.async.DeferredResult;
import org.springframework.web.servlet.mvc.method.annotation.SseEmitter;
import reactor.core.publisher.BaseSubscriber;
import reactor.core.publisher.Flux;

/**
 * Relays a chat stream to an {@link SseEmitter} one chunk at a time.
 *
 * <p>Invariants: the HTTP response is handed out only after the first chunk (or the
 * end of the stream) arrived, so an error before any output (rate limit, sidecar down,
 * bad input) still becomes a proper HTTP status; exactly one chunk is requested per
 * chunk written, so a slow HTTP client slows the sidecar stream instead of filling
 * memory; a client that goes away, or an emitter timeout, cancels the subscription and
 * with it the sidecar call (also while still waiting for the first chunk).
 */
final class SseRelay extends BaseSubscriber<ChatResponse> {

    private final SseEmitter emitter;
    private final DeferredResult<SseEmitter> ready;
    private final Function<ChatResponse, Map<String, Object>> doneEvent;
    private ChatResponse last;

    private SseRelay(SseEmitter emitter, Long timeoutMs, Function<ChatResponse, Map<String, Object>> doneEvent) {
        this.emitter = emitter;
        this.ready = new DeferredResult<>(timeoutMs);
        this.doneEvent = doneEvent;
        emitter.onTimeout(this::dispose);
        emitter.onError(t -> dispose());
        emitter.onCompletion(this::dispose);
        // Before the first chunk: the async request timed out or the client went away.
        ready.onTimeout(this::dispose);
        ready.onError(t -> dispose());
    }

    /**
     * Subscribes to {@code source}; the result is the emitter once the first chunk is
     * written, or the stream's error if it fails before that. {@code timeoutMs} bounds both
     * the wait for the first chunk and the whole stream (null: the MVC async default).
     */
    static DeferredResult<SseEmitter> relay(Flux<ChatResponse> source, Long timeoutMs,
                                               Function<ChatResponse, Map<String, Object>> doneEvent) {
        SseRelay relay = new SseRelay(new SseEmitter(timeoutMs), timeoutMs, doneEvent);
        source.subscribe(relay);
        return relay.ready;
    }

    @Override
    protected void hookOnSubscribe(Subscription subscription) {
        subscription.request(1);
    }

    @Override
    protected void hookOnNext(ChatResponse r) {
        last = r;
        String text = r.getResult() == null ? null : r.getResult().getOutput().getText();
        try {
            if (text != null && !text.isEmpty()) {
                emitter.send(SseEmitter.event().name("delta").data(Map.of("text", text), MediaType.APPLICATION_JSON));
            }
        } catch (IOException | IllegalStateException e) {
            dispose();  // the client is gone: cancel the sidecar call
            return;
        }
        ready.setResult(emitter);
        request(1);
    }

    @Override
    protected void hookOnComplete() {
        ready.setResult(emitter);
        try {
            emitter.send(SseEmitter.event().name("done").data(doneEvent.apply(last), MediaType.APPLICATION_JSON));
            emitter.complete();
        } catch (IOException | IllegalStateException e) {
            emitter.completeWithError(e);
        }
    }

    @Override
    protected void hookOnError(Throwable error) {
        if (ready.setErrorResult(error)) {
            return;  // nothing sent yet: the exception handler answers with a status code
        }
        try {
            emitter.send(SseEmitter.event().name("error")
                    .data(Map.of("error", ChatExceptionHandler.errorCode(error), "message", String.valueOf(error.getMessage())),
                            MediaType.APPLICATION_JSON));
            emitter.complete();
        } catch (IOException | IllegalStateException e) {
            emitter.completeWithError(e);
        }
    }
}
