package dev.sidecar.client;

import io.grpc.Attributes;
import io.grpc.EquivalentAddressGroup;
import io.grpc.NameResolver;
import io.grpc.NameResolverProvider;
import java.net.InetSocketAddress;
import java.net.SocketAddress;
import java.net.URI;
import java.util.Collection;
import java.util.List;
import java.util.Set;

/** Resolves {@code <scheme>:///...} to a fixed list of addresses: several in-process replicas behind one target. */
final class StaticProvider extends NameResolverProvider {
    private final String scheme;
    private final List<SocketAddress> addresses;

    StaticProvider(String scheme, List<SocketAddress> addresses) {
        this.scheme = scheme;
        this.addresses = addresses;
    }

    @Override
    public NameResolver newNameResolver(URI targetUri, NameResolver.Args args) {
        if (!scheme.equals(targetUri.getScheme())) {
            return null;
        }
        return new NameResolver() {
            @Override
            public String getServiceAuthority() {
                return "sidecar";
            }

            @Override
            public void start(Listener2 listener) {
                listener.onResult(ResolutionResult.newBuilder()
                        .setAddressesOrError(io.grpc.StatusOr.fromValue(
                                addresses.stream().map(EquivalentAddressGroup::new).toList()))
                        .setAttributes(Attributes.EMPTY).build());
            }

            @Override
            public void shutdown() {
            }
        };
    }

    @Override
    public String getDefaultScheme() {
        return scheme;
    }

    @Override
    protected boolean isAvailable() {
        return true;
    }

    @Override
    protected int priority() {
        return 5;
    }

    @Override
    public Collection<Class<? extends SocketAddress>> getProducedSocketAddressTypes() {
        return Set.of(InetSocketAddress.class);
    }
}
