package dev.sidecar.client;

import com.google.common.util.concurrent.FutureCallback;
import com.google.common.util.concurrent.Futures;
import com.google.common.util.concurrent.ListenableFuture;
import com.google.common.util.concurrent.MoreExecutors;
import dev.sidecar.v1.ChatMessage;
import dev.sidecar.v1.ChatRequest;
import dev.sidecar.v1.Completion;
import dev.sidecar.v1.CompletionChunk;
import dev.sidecar.v1.EmbedRequest;
import dev.sidecar.v1.EmbedResponse;
import dev.sidecar.v1.EngineStats;
import dev.sidecar.v1.GenerateRequest;
import dev.sidecar.v1.GetModelInfoRequest;
import dev.sidecar.v1.GetStatsRequest;
import dev.sidecar.v1.InferenceGrpc;
import dev.sidecar.v1.LoadLoraAdapterRequest;
import dev.sidecar.v1.LoraAdapterResponse;
import dev.sidecar.v1.ModelInfo;
import dev.sidecar.v1.TokenizeRequest;
import dev.sidecar.v1.TokenizeResponse;
import dev.sidecar.v1.UnloadLoraAdapterRequest;
import io.grpc.CallOptions;
import io.grpc.Channel;
import io.grpc.ClientInterceptor;
import io.grpc.ClientInterceptors;
import io.grpc.ManagedChannel;
import io.grpc.StatusRuntimeException;
import java.time.Duration;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import java.util.function.Function;
import reactor.core.publisher.Flux;

/**
 * Client for the llm-sidecar wire API ({@code sidecar.v1.Inference}).
 *
 * <p>Thread-safe; create one per application and {@link #close()} it on shutdown. Every
 * method raises a {@link SidecarException} subclass chosen by the gRPC status code
 * (blocking methods throw it, futures complete with it, fluxes signal it).
 *
 * <pre>{@code
 * try (SidecarClient client = SidecarClient.builder().target("localhost:50051").build()) {
 *     Completion c = client.chat(ChatRequest.newBuilder()
 *             .addMessages(SidecarClient.user("Hello")).build());
 * }
 * }</pre>
 */
public final class SidecarClient implements AutoCloseable {

    private final ManagedChannel managedChannel;
    private final boolean ownsChannel;
    private final Channel channel;
    private final Duration defaultDeadline;
    private final Duration defaultStreamDeadline;
    private final Integer maxInboundMessageSize;
    private final Duration shutdownTimeout;

    SidecarClient(ManagedChannel managedChannel, boolean ownsChannel, List<ClientInterceptor> interceptors,
                  Duration defaultDeadline, Duration defaultStreamDeadline, Integer maxInboundMessageSize,
                  Duration shutdownTimeout) {
        this.managedChannel = managedChannel;
        this.ownsChannel = ownsChannel;
        this.channel = ClientInterceptors.intercept(managedChannel, interceptors);
        this.defaultDeadline = defaultDeadline;
        this.defaultStreamDeadline = defaultStreamDeadline;
        this.maxInboundMessageSize = maxInboundMessageSize;
        this.shutdownTimeout = shutdownTimeout;
    }

    public static SidecarClientBuilder builder() {
        return new SidecarClientBuilder();
    }

    /** A chat message with role "system". */
    public static ChatMessage system(String content) {
        return ChatMessage.newBuilder().setRole("system").setContent(content).build();
    }

    /** A chat message with role "user". */
    public static ChatMessage user(String content) {
        return ChatMessage.newBuilder().setRole("user").setContent(content).build();
    }

    /** A chat message with role "assistant". */
    public static ChatMessage assistant(String content) {
        return ChatMessage.newBuilder().setRole("assistant").setContent(content).build();
    }

    // ---- chat / generate -------------------------------------------------------------
    //
    // Every call has an overload taking its own deadline: a positive Duration, or null for
    // the client's default (defaultDeadline for unary calls, defaultStreamDeadline for
    // streams). A deadline counts from the call's start (a stream's from subscription).

    public Completion chat(ChatRequest request) {
        return chat(request, null);
    }

    public Completion chat(ChatRequest request, Duration deadline) {
        return blocking(s -> s.chat(request), unary(deadline));
    }

    public Completion generate(GenerateRequest request) {
        return generate(request, null);
    }

    public Completion generate(GenerateRequest request, Duration deadline) {
        return blocking(s -> s.generate(request), unary(deadline));
    }

    /** Completes a raw text prompt with the server's default sampling settings. */
    public Completion generate(String prompt) {
        return generate(GenerateRequest.newBuilder().setPrompt(prompt).build());
    }

    /** Cancelling the returned future cancels the call. */
    public CompletableFuture<Completion> chatAsync(ChatRequest request) {
        return chatAsync(request, null);
    }

    public CompletableFuture<Completion> chatAsync(ChatRequest request, Duration deadline) {
        return async(futureStub(unary(deadline)).chat(request));
    }

    /** Cancelling the returned future cancels the call. */
    public CompletableFuture<Completion> generateAsync(GenerateRequest request) {
        return generateAsync(request, null);
    }

    public CompletableFuture<Completion> generateAsync(GenerateRequest request, Duration deadline) {
        return async(futureStub(unary(deadline)).generate(request));
    }

    /**
     * Streams the chat completion as deltas. The call starts on subscription; chunks are
     * pulled from the server only as fast as the subscriber requests them, and cancelling
     * the subscription cancels the call (the sidecar aborts the request).
     */
    public Flux<CompletionChunk> chatStream(ChatRequest request) {
        return chatStream(request, null);
    }

    public Flux<CompletionChunk> chatStream(ChatRequest request, Duration deadline) {
        Duration d = stream(deadline);
        return StreamingCall.flux(channel, InferenceGrpc.getChatStreamMethod(), () -> callOptions(d), request);
    }

    /** Streaming variant of {@link #generate(GenerateRequest)}; see {@link #chatStream}. */
    public Flux<CompletionChunk> generateStream(GenerateRequest request) {
        return generateStream(request, null);
    }

    public Flux<CompletionChunk> generateStream(GenerateRequest request, Duration deadline) {
        Duration d = stream(deadline);
        return StreamingCall.flux(channel, InferenceGrpc.getGenerateStreamMethod(), () -> callOptions(d), request);
    }

    // ---- other RPCs ------------------------------------------------------------------

    public EmbedResponse embed(EmbedRequest request) {
        return embed(request, null);
    }

    public EmbedResponse embed(EmbedRequest request, Duration deadline) {
        return blocking(s -> s.embed(request), unary(deadline));
    }

    public EmbedResponse embed(List<String> inputs) {
        return embed(EmbedRequest.newBuilder().addAllInputs(inputs).build());
    }

    public TokenizeResponse tokenize(TokenizeRequest request) {
        return blocking(s -> s.tokenize(request), defaultDeadline);
    }

    public TokenizeResponse tokenize(String text) {
        return tokenize(TokenizeRequest.newBuilder().setText(text).build());
    }

    public ModelInfo modelInfo() {
        return blocking(s -> s.getModelInfo(GetModelInfoRequest.getDefaultInstance()), defaultDeadline);
    }

    public EngineStats stats() {
        return blocking(s -> s.getStats(GetStatsRequest.getDefaultInstance()), defaultDeadline);
    }

    /**
     * Operator action: serves the PEFT adapter directory {@code path} (on the sidecar's host, under one
     * of its {@code --lora-root} directories) to every tenant as model {@code name}. Needs a client built
     * with an operator key ({@code --admin-key}) when the sidecar has keys: a tenant key gets
     * {@link PermissionDeniedException}.
     */
    public LoraAdapterResponse loadLoraAdapter(String name, String path) {
        return loadLoraAdapter(name, path, null);
    }

    /**
     * As {@link #loadLoraAdapter(String, String)}, for the keys of {@code tenant} alone (null or empty:
     * every tenant); to other tenants the adapter is an unknown model.
     */
    public LoraAdapterResponse loadLoraAdapter(String name, String path, String tenant) {
        LoadLoraAdapterRequest.Builder request = LoadLoraAdapterRequest.newBuilder().setLoraName(name).setLoraPath(path);
        if (tenant != null) {
            request.setTenant(tenant);
        }
        return blocking(s -> s.loadLoraAdapter(request.build()), defaultDeadline);
    }

    /**
     * Operator action: stops serving adapter {@code name}. Refused with FAILED_PRECONDITION
     * ({@link SidecarException}) while requests are using it.
     */
    public LoraAdapterResponse unloadLoraAdapter(String name) {
        UnloadLoraAdapterRequest request = UnloadLoraAdapterRequest.newBuilder().setLoraName(name).build();
        return blocking(s -> s.unloadLoraAdapter(request), defaultDeadline);
    }

    /**
     * The channel calls go through (with the client's interceptors, e.g. the API key),
     * for other services on the same server such as {@code grpc.health.v1.Health}.
     */
    public Channel channel() {
        return channel;
    }

    /** The default deadline of unary calls; null when they have none. */
    public Duration defaultDeadline() {
        return defaultDeadline;
    }

    /** The default deadline of streaming calls; null when they have none. */
    public Duration defaultStreamDeadline() {
        return defaultStreamDeadline;
    }

    /**
     * Shuts the channel down if this client created it: in-flight calls get
     * {@code shutdownTimeout} to finish, then are cancelled. An injected channel is left
     * to its owner.
     */
    @Override
    public void close() {
        if (!ownsChannel || managedChannel.isShutdown()) {
            return;
        }
        managedChannel.shutdown();
        try {
            if (!managedChannel.awaitTermination(shutdownTimeout.toMillis(), TimeUnit.MILLISECONDS)) {
                managedChannel.shutdownNow();
                managedChannel.awaitTermination(1, TimeUnit.SECONDS);
            }
        } catch (InterruptedException e) {
            managedChannel.shutdownNow();
            Thread.currentThread().interrupt();
        }
    }

    // ---- internals -------------------------------------------------------------------

    private Duration unary(Duration deadline) {
        return checked(deadline) != null ? deadline : defaultDeadline;
    }

    private Duration stream(Duration deadline) {
        return checked(deadline) != null ? deadline : defaultStreamDeadline;
    }

    private static Duration checked(Duration deadline) {
        if (deadline != null && (deadline.isNegative() || deadline.isZero())) {
            throw new IllegalArgumentException("deadline: must be positive, got " + deadline);
        }
        return deadline;
    }

    private CallOptions callOptions(Duration deadline) {
        CallOptions options = CallOptions.DEFAULT;
        if (deadline != null) {
            options = options.withDeadlineAfter(deadline.toNanos(), TimeUnit.NANOSECONDS);
        }
        if (maxInboundMessageSize != null) {
            options = options.withMaxInboundMessageSize(maxInboundMessageSize);
        }
        return options;
    }

    private <T> T blocking(Function<InferenceGrpc.InferenceBlockingStub, T> call, Duration deadline) {
        InferenceGrpc.InferenceBlockingStub stub = applyOptions(InferenceGrpc.newBlockingStub(channel), deadline);
        try {
            return call.apply(stub);
        } catch (StatusRuntimeException e) {
            throw SidecarErrors.from(e);
        }
    }

    private InferenceGrpc.InferenceFutureStub futureStub(Duration deadline) {
        return applyOptions(InferenceGrpc.newFutureStub(channel), deadline);
    }

    private <S extends io.grpc.stub.AbstractStub<S>> S applyOptions(S stub, Duration deadline) {
        if (deadline != null) {
            stub = stub.withDeadlineAfter(deadline.toNanos(), TimeUnit.NANOSECONDS);
        }
        if (maxInboundMessageSize != null) {
            stub = stub.withMaxInboundMessageSize(maxInboundMessageSize);
        }
        return stub;
    }

    private static <T> CompletableFuture<T> async(ListenableFuture<T> call) {
        CompletableFuture<T> result = new CompletableFuture<>();
        Futures.addCallback(call, new FutureCallback<>() {
            @Override
            public void onSuccess(T value) {
                result.complete(value);
            }

            @Override
            public void onFailure(Throwable t) {
                result.completeExceptionally(SidecarErrors.from(t));
            }
        }, MoreExecutors.directExecutor());
        // Propagate cancellation of the caller's future to the RPC.
        result.whenComplete((v, t) -> {
            if (result.isCancelled()) {
                call.cancel(true);
            }
        });
        return result;
    }
}
