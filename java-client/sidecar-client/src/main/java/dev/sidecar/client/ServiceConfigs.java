package dev.sidecar.client;

import java.time.Duration;
import java.util.List;
import java.util.Map;

/**
 * Builds the gRPC service config the client installs on channels it creates: the load
 * balancing policy and a retry policy for UNAVAILABLE (loading, draining or an
 * unreachable replica), and optionally client-side health checking. grpc-java only replays a call that has not yet received a
 * response, so a stream is never retried after its first chunk arrived.
 */
final class ServiceConfigs {

    static final String SERVICE = "sidecar.v1.Inference";

    private ServiceConfigs() {
    }

    static Map<String, Object> build(String loadBalancingPolicy, int maxAttempts, Duration initialBackoff,
                                     Duration maxBackoff, boolean healthCheck) {
        Map<String, Object> method;
        if (maxAttempts > 1) {
            Map<String, Object> retry = Map.of(
                    "maxAttempts", (double) maxAttempts,
                    "initialBackoff", seconds(initialBackoff),
                    "maxBackoff", seconds(maxBackoff),
                    "backoffMultiplier", 2.0,
                    "retryableStatusCodes", List.of("UNAVAILABLE"));
            method = Map.of("name", List.of(Map.of("service", SERVICE)), "retryPolicy", retry);
        } else {
            method = Map.of("name", List.of(Map.of("service", SERVICE)));
        }
        Map<String, Object> config = new java.util.HashMap<>();
        config.put("loadBalancingConfig", List.of(Map.of(loadBalancingPolicy, Map.of())));
        config.put("methodConfig", List.of(method));
        if (healthCheck) {
            // Served by grpc-services' health-checking round_robin: a subchannel whose server
            // reports anything but SERVING for this service is not picked.
            config.put("healthCheckConfig", Map.of("serviceName", SERVICE));
        }
        return config;
    }

    // The service config's duration format: decimal seconds with an "s" suffix.
    private static String seconds(Duration d) {
        return String.format(java.util.Locale.ROOT, "%.3fs", d.toNanos() / 1e9);
    }
}
