package dev.sidecar.it;

import dev.sidecar.client.SidecarClient;
import io.grpc.ManagedChannel;
import io.grpc.StatusRuntimeException;
import io.grpc.health.v1.HealthCheckRequest;
import io.grpc.health.v1.HealthCheckResponse;
import io.grpc.health.v1.HealthGrpc;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * The real Python sidecar as a child process: {@code <sidecar.python> -m sidecar serve}
 * on free ports, run from {@code <sidecar.repo>}. {@link #start} returns once the
 * standard health service reports SERVING; {@link #close} sends SIGTERM and waits
 * (SIGKILL after 30 s), so no process outlives the tests.
 */
public final class SidecarProcess implements AutoCloseable {

    static final Duration START_TIMEOUT = Duration.ofSeconds(120);
    private static final List<String> DEFAULT_ARGS = List.of("--model", "demo", "--device", "cpu",
            "--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0", "--log-level", "warning");

    private final Process process;
    private final Path dir;
    private final Path log;
    private final int grpcPort;
    private final int httpPort;

    private SidecarProcess(Process process, Path dir, Path log, int grpcPort, int httpPort) {
        this.process = process;
        this.dir = dir;
        this.log = log;
        this.grpcPort = grpcPort;
        this.httpPort = httpPort;
    }

    /**
     * Starts a sidecar with the default arguments followed by {@code extraArgs} (later flags
     * win), without the semantic cache (no embedder to load).
     */
    public static SidecarProcess start(String... extraArgs) throws IOException, InterruptedException {
        return start(false, extraArgs);
    }

    /** As {@link #start(String...)}; {@code semanticCache} loads the embedder and enables the cache and Embed. */
    public static SidecarProcess start(boolean semanticCache, String... extraArgs)
            throws IOException, InterruptedException {
        String python = System.getProperty("sidecar.python");
        if (python == null || python.isBlank()) {
            throw new IllegalStateException("System property sidecar.python is not set: the integration tests "
                    + "start the real Python sidecar. Run `make test-java`, or `mvn verify "
                    + "-Dsidecar.python=<venv>/bin/python -Dsidecar.repo=<repository root>`.");
        }
        String repoProp = System.getProperty("sidecar.repo");
        Path repo = Path.of(repoProp == null || repoProp.isBlank() ? "../.." : repoProp).toAbsolutePath().normalize();
        if (!Files.isDirectory(repo.resolve("sidecar"))) {
            throw new IllegalStateException("System property sidecar.repo must be the repository root "
                    + "(the directory holding the sidecar package), got " + repo);
        }
        Path dir = Files.createTempDirectory("sidecar-it-");
        Path portFile = dir.resolve("ports.json");
        Path log = dir.resolve("sidecar.log");
        List<String> cmd = new ArrayList<>(List.of(python, "-m", "sidecar", "serve"));
        cmd.addAll(DEFAULT_ARGS);
        if (!semanticCache) {
            cmd.add("--no-semantic-cache");
        }
        cmd.addAll(List.of("--port-file", portFile.toString()));
        cmd.addAll(List.of(extraArgs));
        ProcessBuilder pb = new ProcessBuilder(cmd).directory(repo.toFile())
                .redirectErrorStream(true).redirectOutput(log.toFile());
        pb.environment().put("PYTHONUNBUFFERED", "1");
        Process process = pb.start();
        try {
            long deadline = System.nanoTime() + START_TIMEOUT.toNanos();
            String ports = waitForPortFile(process, portFile, log, deadline);
            SidecarProcess sidecar = new SidecarProcess(process, dir, log, field(ports, "grpc_port"),
                    field(ports, "http_port"));
            sidecar.waitServing(deadline);
            return sidecar;
        } catch (IOException | InterruptedException | RuntimeException e) {
            stop(process);
            throw e;
        }
    }

    private static String waitForPortFile(Process p, Path portFile, Path log, long deadline)
            throws IOException, InterruptedException {
        while (System.nanoTime() < deadline) {
            if (!p.isAlive()) {
                throw new IllegalStateException("sidecar exited with " + p.exitValue() + " during startup:\n" + tail(log));
            }
            if (Files.exists(portFile)) {
                // The server writes the file atomically (rename), so it is complete when seen.
                return Files.readString(portFile, StandardCharsets.UTF_8);
            }
            Thread.sleep(50);
        }
        throw new IllegalStateException("sidecar did not write its port file within " + START_TIMEOUT + ":\n" + tail(log));
    }

    private static int field(String json, String name) {
        Matcher m = Pattern.compile("\"" + name + "\"\\s*:\\s*(-?\\d+)").matcher(json);
        if (!m.find()) {
            throw new IllegalStateException("port file has no " + name + ": " + json);
        }
        return Integer.parseInt(m.group(1));
    }

    private void waitServing(long deadline) throws InterruptedException {
        ManagedChannel ch = io.grpc.Grpc.newChannelBuilder(grpcTarget(),
                io.grpc.InsecureChannelCredentials.create()).build();
        try {
            while (System.nanoTime() < deadline) {
                if (!process.isAlive()) {
                    throw new IllegalStateException("sidecar exited with " + process.exitValue()
                            + " while loading:\n" + tail(log));
                }
                try {
                    HealthCheckResponse r = HealthGrpc.newBlockingStub(ch).withDeadlineAfter(5, TimeUnit.SECONDS)
                            .check(HealthCheckRequest.newBuilder().setService("sidecar.v1.Inference").build());
                    if (r.getStatus() == HealthCheckResponse.ServingStatus.SERVING) {
                        return;
                    }
                } catch (StatusRuntimeException e) {
                    // not listening yet or still loading
                }
                Thread.sleep(100);
            }
            throw new IllegalStateException("sidecar not SERVING within " + START_TIMEOUT + ":\n" + tail(log));
        } finally {
            ch.shutdownNow();
        }
    }

    public int grpcPort() {
        return grpcPort;
    }

    public int httpPort() {
        return httpPort;
    }

    public String grpcTarget() {
        return "127.0.0.1:" + grpcPort;
    }

    public String httpBase() {
        return "http://127.0.0.1:" + httpPort;
    }

    /** A plaintext client for this sidecar; the caller closes it. */
    public SidecarClient client() {
        return SidecarClient.builder().target(grpcTarget()).defaultDeadline(Duration.ofSeconds(60)).build();
    }

    /** The last part of the sidecar's log, for failure messages. */
    public String logTail() {
        return tail(log);
    }

    private static String tail(Path log) {
        try {
            String s = Files.readString(log, StandardCharsets.UTF_8);
            return s.length() > 4000 ? s.substring(s.length() - 4000) : s;
        } catch (IOException e) {
            return "(no log: " + e.getMessage() + ")";
        }
    }

    /** Sends SIGTERM and returns at once: the sidecar reports NOT_SERVING and drains its running requests. */
    public void beginDrain() {
        process.destroy();
    }

    public boolean isAlive() {
        return process.isAlive();
    }

    /** Stops the process and removes its port file and log. */
    @Override
    public void close() {
        stop(process);
        try (var files = Files.list(dir)) {
            for (Path f : files.toList()) {
                Files.deleteIfExists(f);
            }
            Files.deleteIfExists(dir);
        } catch (IOException e) {
            // a leftover temp file is harmless; the process is what must not leak
        }
    }

    private static void stop(Process p) {
        if (!p.isAlive()) {
            return;
        }
        p.destroy();  // SIGTERM: the sidecar drains and exits
        try {
            if (!p.waitFor(30, TimeUnit.SECONDS)) {
                p.destroyForcibly();
                p.waitFor(10, TimeUnit.SECONDS);
            }
        } catch (InterruptedException e) {
            p.destroyForcibly();
            Thread.currentThread().interrupt();
        }
    }
}
