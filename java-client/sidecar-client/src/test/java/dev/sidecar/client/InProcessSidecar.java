package dev.sidecar.client;

import io.grpc.Server;
import io.grpc.ServerInterceptors;
import io.grpc.inprocess.InProcessChannelBuilder;
import io.grpc.inprocess.InProcessServerBuilder;
import java.io.IOException;
import java.util.concurrent.TimeUnit;

/** An in-process server running a {@link FakeInference}, stopped by close(). */
final class InProcessSidecar implements AutoCloseable {

    final FakeInference service = new FakeInference();
    final String name = InProcessServerBuilder.generateName();
    private final Server server;

    InProcessSidecar() throws IOException {
        server = InProcessServerBuilder.forName(name)
                .addService(ServerInterceptors.intercept(service, service.headerRecorder))
                .build()
                .start();
    }

    /** A client builder whose channel (owned by the client) connects to this server. */
    SidecarClientBuilder clientBuilder() {
        return SidecarClient.builder().channelBuilder(InProcessChannelBuilder.forName(name));
    }

    @Override
    public void close() throws InterruptedException {
        server.shutdownNow();
        server.awaitTermination(5, TimeUnit.SECONDS);
    }
}
