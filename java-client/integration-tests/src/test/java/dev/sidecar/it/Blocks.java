package dev.sidecar.it;

import static org.assertj.core.api.Assertions.assertThat;

import dev.sidecar.client.SidecarClient;
import dev.sidecar.v1.EngineStats;

/** Polls the sidecar's GetStats until every KV block is free again. */
final class Blocks {

    private Blocks() {
    }

    static EngineStats awaitAllFree(SidecarClient client, long timeoutMs) throws InterruptedException {
        long end = System.nanoTime() + timeoutMs * 1_000_000L;
        EngineStats s = client.stats();
        while ((s.getNumFreeKvBlocks() != s.getNumKvBlocks() || s.getNumRunning() != 0) && System.nanoTime() < end) {
            Thread.sleep(100);
            s = client.stats();
        }
        assertThat(s.getNumFreeKvBlocks()).as("free KV blocks after the request ended: %s", s)
                .isEqualTo(s.getNumKvBlocks());
        assertThat(s.getNumRunning()).isZero();
        return s;
    }
}
