package dev.sidecar.it;

import java.util.Arrays;
import java.util.List;
import org.junit.jupiter.api.extension.BeforeAllCallback;
import org.junit.jupiter.api.extension.ExtensionContext;

/**
 * JUnit extension giving a test class a real sidecar. Sidecars with the same arguments
 * are shared by all test classes of the run and stopped when the run ends (they live in
 * the root extension store, which closes them), so the model loads once per variant.
 *
 * <pre>{@code @RegisterExtension static final RealSidecar SIDECAR = RealSidecar.with();}</pre>
 */
public final class RealSidecar implements BeforeAllCallback {

    private static final ExtensionContext.Namespace NS = ExtensionContext.Namespace.create(RealSidecar.class);

    private final List<String> args;
    private volatile SidecarProcess process;

    private RealSidecar(List<String> args) {
        this.args = args;
    }

    /** A sidecar with the default flags plus these (no semantic cache). */
    public static RealSidecar with(String... extraArgs) {
        return new RealSidecar(Arrays.asList(extraArgs));
    }

    /** A sidecar with the semantic cache and Embed enabled (loads the embedder), plus these flags. */
    public static RealSidecar withSemanticCache(String... extraArgs) {
        List<String> args = new java.util.ArrayList<>(List.of(SEMANTIC_CACHE));
        args.addAll(Arrays.asList(extraArgs));
        return new RealSidecar(args);
    }

    // Marks the variant in the shared store's key; not passed to the sidecar.
    private static final String SEMANTIC_CACHE = "<semantic-cache>";

    @Override
    public void beforeAll(ExtensionContext context) {
        Holder h = context.getRoot().getStore(NS).getOrComputeIfAbsent(args, k -> new Holder(args), Holder.class);
        process = h.get();
    }

    public SidecarProcess process() {
        if (process == null) {
            throw new IllegalStateException("sidecar not started: register RealSidecar with @RegisterExtension");
        }
        return process;
    }

    /** Starts lazily; a failed start is rethrown to every class that needs it. */
    private static final class Holder implements ExtensionContext.Store.CloseableResource {
        private final List<String> args;
        private SidecarProcess process;
        private RuntimeException failure;

        Holder(List<String> args) {
            this.args = args;
        }

        synchronized SidecarProcess get() {
            if (process == null && failure == null) {
                try {
                    boolean cache = args.contains(SEMANTIC_CACHE);
                    process = SidecarProcess.start(cache, args.stream().filter(a -> !a.equals(SEMANTIC_CACHE))
                            .toArray(String[]::new));
                } catch (Exception e) {
                    if (e instanceof InterruptedException) {
                        Thread.currentThread().interrupt();
                    }
                    failure = e instanceof RuntimeException re ? re : new IllegalStateException(e.getMessage(), e);
                }
            }
            if (failure != null) {
                throw failure;
            }
            return process;
        }

        @Override
        public synchronized void close() {
            if (process != null) {
                process.close();
            }
        }
    }
}
