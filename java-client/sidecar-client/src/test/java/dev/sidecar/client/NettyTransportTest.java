package dev.sidecar.client;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import io.grpc.Grpc;
import io.grpc.InsecureServerCredentials;
import io.grpc.Server;
import io.grpc.ServerInterceptors;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;

/** Exercises the client's own channel construction over real TCP (Netty) on loopback. */
class NettyTransportTest {

    private final FakeInference service = new FakeInference();
    private Server server;

    @BeforeEach
    void setUp() throws Exception {
        server = Grpc.newServerBuilderForPort(0, InsecureServerCredentials.create())
                .addService(ServerInterceptors.intercept(service, service.headerRecorder))
                .build().start();
    }

    @AfterEach
    void tearDown() throws Exception {
        server.shutdownNow();
        server.awaitTermination(5, TimeUnit.SECONDS);
    }

    @Test
    void hostPortAndDnsTargetsConnect() {
        try (SidecarClient client = SidecarClient.builder().target("127.0.0.1:" + server.getPort()).build()) {
            assertThat(client.generate("tcp").getText()).isEqualTo("echo: tcp");
        }
        try (SidecarClient client = SidecarClient.builder().target("dns:///localhost:" + server.getPort())
                .apiKey("k").build()) {
            assertThat(client.modelInfo().getModel()).isEqualTo("demo");
        }
        assertThat(service.headers).hasSize(2);
    }

    @Test
    void maxInboundMessageSizeIsEnforced() {
        service.bigText = 64 * 1024;
        try (SidecarClient small = SidecarClient.builder().target("127.0.0.1:" + server.getPort())
                .maxInboundMessageSize(16 * 1024).build()) {
            assertThatThrownBy(() -> small.generate("big"))
                    .isExactlyInstanceOf(MessageTooLargeException.class)
                    .hasMessageContaining("exceeds maximum size");
        }
        try (SidecarClient large = SidecarClient.builder().target("127.0.0.1:" + server.getPort())
                .maxInboundMessageSize(1024 * 1024).build()) {
            assertThat(large.generate("big").getText()).hasSize(64 * 1024);
        }
    }
}
