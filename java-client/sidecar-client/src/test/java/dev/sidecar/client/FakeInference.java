package dev.sidecar.client;

import dev.sidecar.v1.CacheInfo;
import dev.sidecar.v1.CacheStatus;
import dev.sidecar.v1.ChatRequest;
import dev.sidecar.v1.Completion;
import dev.sidecar.v1.CompletionChunk;
import dev.sidecar.v1.EmbedRequest;
import dev.sidecar.v1.EmbedResponse;
import dev.sidecar.v1.Embedding;
import dev.sidecar.v1.EngineStats;
import dev.sidecar.v1.FinishReason;
import dev.sidecar.v1.GenerateRequest;
import dev.sidecar.v1.GetModelInfoRequest;
import dev.sidecar.v1.GetStatsRequest;
import dev.sidecar.v1.InferenceGrpc;
import dev.sidecar.v1.ModelInfo;
import dev.sidecar.v1.TokenizeRequest;
import dev.sidecar.v1.TokenizeResponse;
import dev.sidecar.v1.Usage;
import io.grpc.Metadata;
import io.grpc.ServerCall;
import io.grpc.ServerCallHandler;
import io.grpc.ServerInterceptor;
import io.grpc.Status;
import io.grpc.stub.ServerCallStreamObserver;
import io.grpc.stub.StreamObserver;
import java.util.List;
import java.util.concurrent.ConcurrentLinkedQueue;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * Scriptable fake of the sidecar's Inference service. Completions echo the last user
 * message so tests can check what reached the server; failures queued in
 * {@link #failNext} are returned by the next calls in order.
 */
final class FakeInference extends InferenceGrpc.InferenceImplBase {

    record Failure(Status status, Metadata trailers) {
    }

    final ConcurrentLinkedQueue<Failure> failNext = new ConcurrentLinkedQueue<>();
    final AtomicInteger calls = new AtomicInteger();
    final ConcurrentLinkedQueue<Metadata> headers = new ConcurrentLinkedQueue<>();
    volatile Object lastRequest;
    /** The deadline the last call arrived with (null when it had none). */
    volatile io.grpc.Deadline lastDeadline;

    /** Number of chunks a stream sends (each only while the client has demand). */
    volatile int streamChunks = 5;
    final AtomicInteger chunksSent = new AtomicInteger();
    final CountDownLatch cancelled = new CountDownLatch(1);
    /** When true, unary calls never answer (for deadline tests); the cancel is recorded. */
    volatile boolean hang;
    /** Size of the text in unary completions when > 0 (for message size tests). */
    volatile int bigText;

    /** Records request headers; install with ServerInterceptors.intercept. */
    final ServerInterceptor headerRecorder = new ServerInterceptor() {
        @Override
        public <Q, R> ServerCall.Listener<Q> interceptCall(ServerCall<Q, R> call, Metadata h,
                                                            ServerCallHandler<Q, R> next) {
            headers.add(h);
            return next.startCall(call, h);
        }
    };

    static Completion completion(String text) {
        return Completion.newBuilder()
                .setRequestId("req-1")
                .setText(text)
                .setFinishReason(FinishReason.FINISH_REASON_STOP)
                .setUsage(Usage.newBuilder().setPromptTokens(7).setCompletionTokens(3).setCachedTokens(4)
                        .setTotalTokens(10))
                .setCache(CacheInfo.newBuilder().setStatus(CacheStatus.CACHE_STATUS_MISS))
                .setModel("demo")
                .build();
    }

    private boolean failed(StreamObserver<?> observer) {
        calls.incrementAndGet();
        lastDeadline = io.grpc.Context.current().getDeadline();
        Failure f = failNext.poll();
        if (f != null) {
            observer.onError(f.status().asRuntimeException(f.trailers()));
            return true;
        }
        if (hang) {
            ((ServerCallStreamObserver<?>) observer).setOnCancelHandler(cancelled::countDown);
            return true;
        }
        return false;
    }

    private void unary(Object request, String echo, StreamObserver<Completion> observer) {
        lastRequest = request;
        if (failed(observer)) {
            return;
        }
        observer.onNext(completion(bigText > 0 ? "x".repeat(bigText) : "echo: " + echo));
        observer.onCompleted();
    }

    @Override
    public void chat(ChatRequest request, StreamObserver<Completion> observer) {
        unary(request, request.getMessages(request.getMessagesCount() - 1).getContent(), observer);
    }

    @Override
    public void generate(GenerateRequest request, StreamObserver<Completion> observer) {
        unary(request, request.getPrompt(), observer);
    }

    @Override
    public void chatStream(ChatRequest request, StreamObserver<CompletionChunk> observer) {
        stream(request, observer);
    }

    @Override
    public void generateStream(GenerateRequest request, StreamObserver<CompletionChunk> observer) {
        stream(request, observer);
    }

    // Sends chunks only while the transport reports the client ready; with the in-process
    // transport that means "the client has requested more messages than it got".
    private void stream(Object request, StreamObserver<CompletionChunk> observer) {
        lastRequest = request;
        if (failed(observer)) {
            return;
        }
        ServerCallStreamObserver<CompletionChunk> server = (ServerCallStreamObserver<CompletionChunk>) observer;
        server.setOnCancelHandler(cancelled::countDown);
        int total = streamChunks;
        AtomicInteger next = new AtomicInteger();
        Runnable drain = () -> {
            while (server.isReady() && !server.isCancelled() && next.get() < total) {
                int i = next.getAndIncrement();
                CompletionChunk.Builder chunk = CompletionChunk.newBuilder().setRequestId("req-s").setDelta("t" + i);
                if (i == total - 1) {
                    chunk.setFinishReason(FinishReason.FINISH_REASON_LENGTH)
                            .setUsage(Usage.newBuilder().setPromptTokens(2).setCompletionTokens(total));
                }
                server.onNext(chunk.build());
                chunksSent.incrementAndGet();
                if (i == total - 1) {
                    server.onCompleted();
                }
            }
        };
        server.setOnReadyHandler(drain);
    }

    @Override
    public void embed(EmbedRequest request, StreamObserver<EmbedResponse> observer) {
        lastRequest = request;
        if (failed(observer)) {
            return;
        }
        EmbedResponse.Builder r = EmbedResponse.newBuilder().setModel("mini").setDimensions(2).setPromptTokens(5);
        for (String s : request.getInputsList()) {
            r.addEmbeddings(Embedding.newBuilder().addAllValues(List.of((float) s.length(), 1f)));
        }
        observer.onNext(r.build());
        observer.onCompleted();
    }

    @Override
    public void tokenize(TokenizeRequest request, StreamObserver<TokenizeResponse> observer) {
        lastRequest = request;
        if (failed(observer)) {
            return;
        }
        TokenizeResponse.Builder r = TokenizeResponse.newBuilder().setMaxModelLen(256);
        request.getText().chars().forEach(c -> r.addTokenIds(c).addTokens(String.valueOf((char) c)));
        observer.onNext(r.setCount(r.getTokenIdsCount()).build());
        observer.onCompleted();
    }

    @Override
    public void getModelInfo(GetModelInfoRequest request, StreamObserver<ModelInfo> observer) {
        if (failed(observer)) {
            return;
        }
        observer.onNext(ModelInfo.newBuilder().setModel("demo").setMaxModelLen(256).setBlockSize(16)
                .setNumKvBlocks(64).build());
        observer.onCompleted();
    }

    @Override
    public void getStats(GetStatsRequest request, StreamObserver<EngineStats> observer) {
        if (failed(observer)) {
            return;
        }
        observer.onNext(EngineStats.newBuilder().setNumKvBlocks(64).setNumFreeKvBlocks(60).setNumRunning(1).build());
        observer.onCompleted();
    }
}
