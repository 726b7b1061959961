package dev.sidecar.demo;

import dev.sidecar.v1.CacheInfo;
import dev.sidecar.v1.CacheStatus;
import dev.sidecar.v1.ChatRequest;
import dev.sidecar.v1.Completion;
import dev.sidecar.v1.CompletionChunk;
import dev.sidecar.v1.FinishReason;
import dev.sidecar.v1.InferenceGrpc;
import dev.sidecar.v1.Usage;
import io.grpc.Metadata;
import io.grpc.Server;
import io.grpc.Status;
import io.grpc.inprocess.InProcessServerBuilder;
import io.grpc.stub.StreamObserver;
import java.io.IOException;
import java.util.concurrent.ConcurrentLinkedQueue;

/**
 * In-process sidecar for the demo tests: answers "echo: <last message>", reports the
 * prompt's earlier messages as prefix-cached tokens, and fails the next call with a
 * scripted status (and retry-after-ms trailer) when asked to.
 */
final class FakeSidecarServer {

    static final String NAME = InProcessServerBuilder.generateName();
    static final ConcurrentLinkedQueue<ChatRequest> CHATS = new ConcurrentLinkedQueue<>();
    static volatile Status failWith;
    static volatile String retryAfterMs;

    static {
        try {
            Server server = InProcessServerBuilder.forName(NAME).addService(new Service()).build().start();
            Runtime.getRuntime().addShutdownHook(new Thread(server::shutdownNow));
        } catch (IOException e) {
            throw new IllegalStateException(e);
        }
    }

    private FakeSidecarServer() {
    }

    static void reset() {
        CHATS.clear();
        failWith = null;
        retryAfterMs = null;
    }

    private static boolean fail(StreamObserver<?> observer) {
        Status s = failWith;
        if (s == null) {
            return false;
        }
        Metadata trailers = new Metadata();
        if (retryAfterMs != null) {
            trailers.put(Metadata.Key.of("retry-after-ms", Metadata.ASCII_STRING_MARSHALLER), retryAfterMs);
        }
        observer.onError(s.asRuntimeException(trailers));
        return true;
    }

    private static String last(ChatRequest r) {
        return r.getMessages(r.getMessagesCount() - 1).getContent();
    }

    private static Usage usage(ChatRequest r) {
        int prompt = r.getMessagesCount() * 10;
        int cached = (r.getMessagesCount() - 1) * 10;
        return Usage.newBuilder().setPromptTokens(prompt).setCompletionTokens(2).setCachedTokens(cached)
                .setTotalTokens(prompt + 2).build();
    }

    private static final class Service extends InferenceGrpc.InferenceImplBase {

        @Override
        public void chat(ChatRequest request, StreamObserver<Completion> observer) {
            CHATS.add(request);
            if (fail(observer)) {
                return;
            }
            boolean hit = last(request).contains("cached");
            observer.onNext(Completion.newBuilder().setRequestId("r").setText("echo: " + last(request))
                    .setFinishReason(FinishReason.FINISH_REASON_STOP).setUsage(usage(request))
                    .setCache(CacheInfo.newBuilder().setStatus(hit ? CacheStatus.CACHE_STATUS_HIT_SEMANTIC
                            : CacheStatus.CACHE_STATUS_MISS).setSimilarity(hit ? 0.9f : 0f))
                    .build());
            observer.onCompleted();
        }

        @Override
        public void chatStream(ChatRequest request, StreamObserver<CompletionChunk> observer) {
            CHATS.add(request);
            if (fail(observer)) {
                return;
            }
            observer.onNext(CompletionChunk.newBuilder().setDelta("echo: ").build());
            observer.onNext(CompletionChunk.newBuilder().setDelta(last(request))
                    .setFinishReason(FinishReason.FINISH_REASON_STOP).setUsage(usage(request)).build());
            observer.onCompleted();
        }
    }
}
