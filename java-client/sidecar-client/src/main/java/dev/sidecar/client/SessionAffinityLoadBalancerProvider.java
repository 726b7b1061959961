package dev.sidecar.client;

import io.grpc.LoadBalancer;
import io.grpc.LoadBalancerProvider;
import io.grpc.NameResolver;
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
        return new SessionAffinityLoadBalancer(helper);
    }

    @Override
    public NameResolver.ConfigOrError parseLoadBalancingPolicyConfig(Map<String, ?> rawConfig) {
        return NameResolver.ConfigOrError.fromConfig(rawConfig == null ? Map.of() : rawConfig);
    }
}
