package dev.sidecar.client;

import io.grpc.LoadBalancer;
import io.grpc.LoadBalancerProvider;
import io.grpc.NameResolver;
import io.grpc.protobuf.services.HealthCheckingLoadBalancerUtil;
import java.util.Map;

/**
 * Registers {@link SessionAffinityLoadBalancer} under {@value #POLICY} (through
 * {@code META-INF/services}); select it with {@code SidecarClient.builder().loadBalancingPolicy(...)}
 * or a service config.
 */
public final class SessionAffinityLoadBalancerProvider extends LoadBalancerProvider {

    /** The policy name. */
    public static final String POLICY = "sidecar_session_affinity";

    @Override
    public boolean isAvailable() {
        return true;
    }

    @Override
    public int getPriority() {
        return 5;
    }

    @Override
    public String getPolicyName() {
        return POLICY;
    }

    @Override
    public LoadBalancer newLoadBalancer(LoadBalancer.Helper helper) {
        // With a healthCheckConfig in the service config (SidecarClientBuilder.healthCheck(true)), a replica
        // whose health service reports anything but SERVING (loading, draining) is not READY to the balancer,
        // so its sessions move to the next replica on the ring until it serves again.
        LoadBalancer.Factory factory = new LoadBalancer.Factory() {
            @Override
            public LoadBalancer newLoadBalancer(LoadBalancer.Helper h) {
                return new SessionAffinityLoadBalancer(h);
            }
        };
        return HealthCheckingLoadBalancerUtil.newHealthCheckingLoadBalancer(factory, helper);
    }

    @Override
    public NameResolver.ConfigOrError parseLoadBalancingPolicyConfig(Map<String, ?> rawConfig) {
        return NameResolver.ConfigOrError.fromConfig(rawConfig == null ? Map.of() : rawConfig);
    }
}
