package dev.sidecar.spring;

import dev.sidecar.v1.CacheInfo;
import dev.sidecar.v1.CacheStatus;
import dev.sidecar.v1.ChatRequest;
import dev.sidecar.v1.Completion;
import dev.sidecar.v1.CompletionChunk;
import dev.sidecar.v1.EmbedRequest;
import dev.sidecar.v1.EmbedResponse;
import dev.sidecar.v1.Embedding;
import dev.sidecar.v1.FinishReason;
import dev.sidecar.v1.GetModelInfoRequest;
import dev.sidecar.v1.InferenceGrpc;
import dev.sidecar.v1.ModelInfo;
import dev.sidecar.v1.Timing;
import dev.sidecar.v1.Usage;
import io.grpc.Metadata;
import io.grpc.Server;
import io.grpc.ServerCall;
import io.grpc.ServerCallHandler;
import io.grpc.ServerInterceptor;
import io.grpc.ServerInterceptors;
import io.grpc.Status;
import io.grpc.inprocess.InProcessChannelBuilder;
import io.grpc.inprocess.InProcessServerBuilder;
import io.grpc.protobuf.services.HealthStatusManager;
import io.grpc.stub.StreamObserver;
import java.io.IOException;
import java.util.List;
import java.util.concurrent.ConcurrentLinkedQueue;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * In-process stand-in for the sidecar: chat echoes the last message (reporting a
 * semantic cache hit when the text contains "cached"), streams split the echo into
 * words, embeddings are [length, 1, 0], and the standard health service is served.
 */
final class FakeSidecar implements AutoCloseable {

    final String name = InProcessServerBuilder.generateName();
    final ConcurrentLinkedQueue<ChatRequest> chats = new ConcurrentLinkedQueue<>();
    final ConcurrentLinkedQueue<EmbedRequest> embeds = new ConcurrentLinkedQueue<>();
    /** The authorization header of each Inference call ("<none>" when absent). */
    final ConcurrentLinkedQueue<String> authorizations = new ConcurrentLinkedQueue<>();
    final AtomicInteger modelInfoCalls = new AtomicInteger();
    final HealthStatusManager health = new HealthStatusManager();
    volatile Status failWith;
    /** Replies used, in order, instead of the echo while any are left. */
    final ConcurrentLinkedQueue<Completion> replies = new ConcurrentLinkedQueue<>();
    /** Streamed replies used, in order, instead of the echo while any are left. */
    final ConcurrentLinkedQueue<List<CompletionChunk>> streamReplies = new ConcurrentLinkedQueue<>();
    /** The deadline each Inference call arrived with (null when it had none). */
    final ConcurrentLinkedQueue<java.util.Optional<io.grpc.Deadline>> deadlines = new ConcurrentLinkedQueue<>();
    private final Server server;

    FakeSidecar() throws IOException {
        server = InProcessServerBuilder.forName(name)
                .addService(ServerInterceptors.intercept(new Service(), new ServerInterceptor() {
                    @Override
                    public <Q, R> ServerCall.Listener<Q> interceptCall(ServerCall<Q, R> call, Metadata headers,
                                                                        ServerCallHandler<Q, R> next) {
                        String auth = headers.get(Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER));
                        authorizations.add(auth == null ? "<none>" : auth);
                        deadlines.add(java.util.Optional.ofNullable(io.grpc.Context.current().getDeadline()));
                        return next.startCall(call, headers);
                    }
                }))
                .addService(health.getHealthService()).build().start();
        health.setStatus("sidecar.v1.Inference", io.grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING);
    }

    InProcessChannelBuilder channelBuilder() {
        return InProcessChannelBuilder.forName(name);
    }

    static String lastContent(ChatRequest r) {
        return r.getMessages(r.getMessagesCount() - 1).getContent();
    }

    private static CacheInfo cache(String text) {
        return text.contains("cached")
                ? CacheInfo.newBuilder().setStatus(CacheStatus.CACHE_STATUS_HIT_SEMANTIC).setSimilarity(0.93f)
                        .setMatchedQuery("a cached question").build()
                : CacheInfo.newBuilder().setStatus(CacheStatus.CACHE_STATUS_MISS).build();
    }

    @Override
    public void close() throws InterruptedException {
        server.shutdownNow();
        server.awaitTermination(5, TimeUnit.SECONDS);
    }

    private final class Service extends InferenceGrpc.InferenceImplBase {

        @Override
        public void chat(ChatRequest request, StreamObserver<Completion> observer) {
            chats.add(request);
            if (failWith != null) {
                observer.onError(failWith.asRuntimeException());
                return;
            }
            Completion scripted = replies.poll();
            if (scripted != null) {
                observer.onNext(scripted);
                observer.onCompleted();
                return;
            }
            String text = "echo: " + lastContent(request);
            observer.onNext(Completion.newBuilder().setRequestId("chat-1").setText(text).setModel("demo")
                    .setFinishReason(FinishReason.FINISH_REASON_STOP)
                    .setUsage(Usage.newBuilder().setPromptTokens(12).setCompletionTokens(4).setCachedTokens(8)
                            .setTotalTokens(16))
                    .setTiming(Timing.newBuilder().setTtftMs(5).setTotalMs(9))
                    .setCache(cache(text)).build());
            observer.onCompleted();
        }

        @Override
        public void chatStream(ChatRequest request, StreamObserver<CompletionChunk> observer) {
            chats.add(request);
            if (failWith != null) {
                observer.onError(failWith.asRuntimeException());
                return;
            }
            List<CompletionChunk> scripted = streamReplies.poll();
            if (scripted != null) {
                scripted.forEach(observer::onNext);
                observer.onCompleted();
                return;
            }
            List<String> words = List.of("echo:", " ", lastContent(request));
            for (int i = 0; i < words.size(); i++) {
                CompletionChunk.Builder c = CompletionChunk.newBuilder().setRequestId("stream-1").setDelta(words.get(i));
                if (i == 0) {
                    c.setCache(cache(""));
                }
                if (i == words.size() - 1) {
                    c.setFinishReason(FinishReason.FINISH_REASON_LENGTH).setCache(cache(""))
                            .setUsage(Usage.newBuilder().setPromptTokens(6).setCompletionTokens(3).setTotalTokens(9));
                }
                observer.onNext(c.build());
            }
            observer.onCompleted();
        }

        @Override
        public void embed(EmbedRequest request, StreamObserver<EmbedResponse> observer) {
            embeds.add(request);
            EmbedResponse.Builder r = EmbedResponse.newBuilder().setModel("mini-embed").setDimensions(3)
                    .setPromptTokens(request.getInputsCount() * 2);
            for (String s : request.getInputsList()) {
                r.addEmbeddings(Embedding.newBuilder().addValues(s.length()).addValues(1f).addValues(0f));
            }
            observer.onNext(r.build());
            observer.onCompleted();
        }

        @Override
        public void getModelInfo(GetModelInfoRequest request, StreamObserver<ModelInfo> observer) {
            modelInfoCalls.incrementAndGet();
            observer.onNext(ModelInfo.newBuilder().setModel("demo").setEmbeddingDimensions(3).build());
            observer.onCompleted();
        }
    }
}
