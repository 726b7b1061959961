package dev.sidecar.client;

import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ClientCall;
import io.grpc.ClientInterceptor;
import io.grpc.Context;
import io.grpc.Metadata;
import io.grpc.MethodDescriptor;
import java.util.Objects;
import java.util.concurrent.Callable;
import java.util.function.Supplier;
import reactor.core.publisher.Flux;

/**
 * Routes the calls of one session (a conversation) to the same replica, so its second turn finds the
 * KV blocks its first turn left in that replica's prefix cache.
 *
 * <p>The key travels as a {@link CallOptions} option ({@link #CALL_OPTION}); the
 * {@value SessionAffinityLoadBalancerProvider#POLICY} load balancer hashes it onto the ring of READY
 * replicas. Calls made through {@link SidecarClient} get it from the gRPC {@link Context}:
 * <pre>{@code
 * Completion c = SessionAffinity.call(sessionId, () -> client.chat(request));
 * Flux<CompletionChunk> s = SessionAffinity.flux(sessionId, () -> client.chatStream(request));
 * }</pre>
 * A call without a key is balanced round-robin. Other stubs may instead send the {@link #HEADER}
 * metadata header, which the balancer reads too.
 */
public final class SessionAffinity {

    /** The affinity key of one call. */
    public static final CallOptions.Key<String> CALL_OPTION = CallOptions.Key.create("sidecar-affinity-key");

    /** The same key as a request header (for stubs that set headers rather than call options). */
    public static final Metadata.Key<String> HEADER = Metadata.Key.of("x-session-id", Metadata.ASCII_STRING_MARSHALLER);

    static final Context.Key<String> CONTEXT = Context.key("sidecar-affinity-key");

    private static final ClientInterceptor INTERCEPTOR = new ClientInterceptor() {
        @Override
        public <Q, R> ClientCall<Q, R> interceptCall(MethodDescriptor<Q, R> method, CallOptions options,
                                                     Channel next) {
            String key = CONTEXT.get();
            if (key != null && options.getOption(CALL_OPTION) == null) {
                options = options.withOption(CALL_OPTION, key);
            }
            return next.newCall(method, options);
        }
    };

    private SessionAffinity() {
    }

    /** Copies the current context's key onto each call's options; the client installs it. */
    public static ClientInterceptor interceptor() {
        return INTERCEPTOR;
    }

    /**
     * Runs {@code body} (blocking or async calls it starts on this thread) with {@code key} as affinity
     * key; a null key runs it as is (round-robin).
     */
    public static <T> T call(String key, Callable<T> body) {
        Objects.requireNonNull(body, "body");
        try {
            if (key == null) {
                return body.call();
            }
            return Context.current().withValue(CONTEXT, checked(key)).call(body);
        } catch (RuntimeException | Error e) {
            throw e;
        } catch (Exception e) {
            throw new IllegalStateException(e);
        }
    }

    /** A Flux whose call, started at subscription, carries {@code key}; a null key adds nothing. */
    public static <T> Flux<T> flux(String key, Supplier<Flux<T>> body) {
        Objects.requireNonNull(body, "body");
        if (key == null) {
            return body.get();
        }
        Context ctx = Context.current().withValue(CONTEXT, checked(key));
        return Flux.from(subscriber -> {
            Context previous = ctx.attach();
            try {
                body.get().subscribe(subscriber);
            } finally {
                ctx.detach(previous);
            }
        });
    }

    private static String checked(String key) {
        if (key == null || key.isBlank()) {
            throw new IllegalArgumentException("affinity key: must be a non-blank session id");
        }
        return key;
    }
}
