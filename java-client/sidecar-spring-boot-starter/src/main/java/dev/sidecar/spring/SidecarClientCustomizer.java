package dev.sidecar.spring;

import dev.sidecar.client.SidecarClientBuilder;

/** Callback to adjust the auto-configured {@link dev.sidecar.client.SidecarClient} before it is built. */
@FunctionalInterface
public interface SidecarClientCustomizer {

    void customize(SidecarClientBuilder builder);
}
