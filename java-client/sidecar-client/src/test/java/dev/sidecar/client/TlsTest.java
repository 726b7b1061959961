package dev.sidecar.client;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

import io.grpc.Grpc;
import io.grpc.Server;
import io.grpc.TlsServerCredentials;
import java.io.InputStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.KeyStore;
import java.util.List;
import java.util.concurrent.TimeUnit;
import javax.net.ssl.KeyManagerFactory;
import org.junit.jupiter.api.AfterEach;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.io.TempDir;

/** TLS through the builder, against a loopback server with a fresh self-signed certificate. */
class TlsTest {

    private static final String PASS = "test-pass";

    @TempDir
    Path dir;

    private Server server;
    private Path certPem;

    /** Runs the JDK's keytool; the certificate is valid for localhost and 127.0.0.1. */
    private void keytool(String... args) throws Exception {
        Path tool = Path.of(System.getProperty("java.home"), "bin", "keytool");
        List<String> cmd = new java.util.ArrayList<>(List.of(tool.toString()));
        cmd.addAll(List.of(args));
        Process p = new ProcessBuilder(cmd).redirectErrorStream(true).start();
        String out = new String(p.getInputStream().readAllBytes());
        assertThat(p.waitFor(60, TimeUnit.SECONDS)).isTrue();
        assertThat(p.exitValue()).as(out).isZero();
    }

    @BeforeEach
    void setUp() throws Exception {
        Path ks = dir.resolve("server.p12");
        certPem = dir.resolve("server.pem");
        keytool("-genkeypair", "-alias", "sidecar", "-keyalg", "EC", "-groupname", "secp256r1",
                "-dname", "CN=localhost", "-ext", "SAN=dns:localhost,ip:127.0.0.1", "-validity", "2",
                "-keystore", ks.toString(), "-storetype", "PKCS12", "-storepass", PASS, "-keypass", PASS);
        keytool("-exportcert", "-rfc", "-alias", "sidecar", "-keystore", ks.toString(), "-storepass", PASS,
                "-file", certPem.toString());

        KeyStore store = KeyStore.getInstance("PKCS12");
        try (InputStream in = Files.newInputStream(ks)) {
            store.load(in, PASS.toCharArray());
        }
        KeyManagerFactory kmf = KeyManagerFactory.getInstance(KeyManagerFactory.getDefaultAlgorithm());
        kmf.init(store, PASS.toCharArray());
        server = Grpc.newServerBuilderForPort(0, TlsServerCredentials.newBuilder()
                        .keyManager(kmf.getKeyManagers()).build())
                .addService(new FakeInference()).build().start();
    }

    @AfterEach
    void tearDown() throws Exception {
        server.shutdownNow().awaitTermination(5, TimeUnit.SECONDS);
    }

    @Test
    void trustedCertificateConnects() {
        try (SidecarClient client = SidecarClient.builder().target("localhost:" + server.getPort())
                .trustedCertificates(certPem).build()) {
            assertThat(client.generate("secure").getText()).isEqualTo("echo: secure");
        }
    }

    @Test
    void untrustedCertificateAndPlaintextAreRefused() {
        try (SidecarClient jvmRoots = SidecarClient.builder().target("localhost:" + server.getPort())
                .tls(true).maxRetryAttempts(1).build()) {
            assertThatThrownBy(() -> jvmRoots.generate("x")).isInstanceOf(SidecarUnavailableException.class);
        }
        try (SidecarClient plaintext = SidecarClient.builder().target("localhost:" + server.getPort())
                .maxRetryAttempts(1).build()) {
            assertThatThrownBy(() -> plaintext.generate("x")).isInstanceOf(SidecarException.class);
        }
    }
}
