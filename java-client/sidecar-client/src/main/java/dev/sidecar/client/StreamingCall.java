package dev.sidecar.client;

import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ClientCall;
import io.grpc.MethodDescriptor;
import io.grpc.stub.ClientCallStreamObserver;
import io.grpc.stub.ClientCalls;
import io.grpc.stub.ClientResponseObserver;
import java.util.function.Supplier;
import reactor.core.publisher.Flux;
import reactor.core.publisher.FluxSink;

/**
 * Bridges a server-streaming gRPC call to a {@link Flux} with end-to-end backpressure.
 *
 * <p>Invariants: the call starts only when the Flux is subscribed (so a deadline counts
 * from subscription); automatic inbound flow control is disabled, so the transport asks
 * the server for exactly as many messages as the subscriber has requested (HTTP/2 flow
 * control then holds the server back); cancelling the subscription cancels the call,
 * which the sidecar turns into an engine abort that frees the request's KV blocks.
 */
final class StreamingCall {

    private StreamingCall() {
    }

    static <Q, R> Flux<R> flux(Channel channel, MethodDescriptor<Q, R> method,
                               Supplier<CallOptions> options, Q request) {
        return Flux.create(sink -> start(channel, method, options.get(), request, sink),
                FluxSink.OverflowStrategy.BUFFER);
    }

    private static <Q, R> void start(Channel channel, MethodDescriptor<Q, R> method, CallOptions options,
                                     Q request, FluxSink<R> sink) {
        ClientCall<Q, R> call = channel.newCall(method, options);
        Bridge<Q, R> bridge = new Bridge<>(sink);
        ClientCalls.asyncServerStreamingCall(call, request, bridge);
        // onRequest replays the demand already signalled, so nothing is lost between
        // subscription and this registration; the call is started, so request() is legal.
        sink.onRequest(bridge::request);
        sink.onCancel(bridge::cancel);
    }

    private static final class Bridge<Q, R> implements ClientResponseObserver<Q, R> {

        private final FluxSink<R> sink;
        private volatile ClientCallStreamObserver<Q> stream;
        // Once the subscriber asked for an unbounded amount, the transport was asked for
        // Integer.MAX_VALUE messages; further requests are ignored so the int counter
        // inside the transport cannot overflow.
        private boolean unbounded;

        Bridge(FluxSink<R> sink) {
            this.sink = sink;
        }

        @Override
        public void beforeStart(ClientCallStreamObserver<Q> requestStream) {
            this.stream = requestStream;
            requestStream.disableAutoRequestWithInitial(0);
        }

        synchronized void request(long n) {
            if (unbounded || n <= 0) {
                return;
            }
            if (n >= Integer.MAX_VALUE) {
                unbounded = true;
                stream.request(Integer.MAX_VALUE);
            } else {
                stream.request((int) n);
            }
        }

        void cancel() {
            stream.cancel("subscriber cancelled", null);
        }

        @Override
        public void onNext(R value) {
            sink.next(value);
        }

        @Override
        public void onError(Throwable t) {
            sink.error(SidecarErrors.from(t));
        }

        @Override
        public void onCompleted() {
            sink.complete();
        }
    }
}
