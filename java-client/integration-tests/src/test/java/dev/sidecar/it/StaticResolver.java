package dev.sidecar.it;

import io.grpc.Attributes;
import io.grpc.EquivalentAddressGroup;
import io.grpc.NameResolver;
import io.grpc.NameResolverProvider;
import io.grpc.NameResolverRegistry;
import io.grpc.StatusOr;
import java.net.InetSocketAddress;
import java.net.SocketAddress;
import java.net.URI;
import java.util.Collection;
import java.util.List;
import java.util.Set;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * A name resolver standing in for a headless Service's DNS name (which cannot hold two
 * ports of 127.0.0.1). Like grpc-java's DNS resolver it answers only when the channel asks
 * (at start and on {@code refresh()}, which the channel does when a connection closes), so
 * a replica added with {@link #setAddresses} is seen only after a reconnect. Registered
 * under its own scheme; {@link #close()} deregisters it.
 */
final class StaticResolver extends NameResolverProvider implements AutoCloseable {

    private static final AtomicInteger IDS = new AtomicInteger();

    private final String scheme = "sidecar-it-" + IDS.incrementAndGet();
    private volatile List<InetSocketAddress> addresses;
    private final List<NameResolver.Listener2> listeners = new CopyOnWriteArrayList<>();
    final AtomicInteger resolutions = new AtomicInteger();

    StaticResolver(List<InetSocketAddress> addresses) {
        this.addresses = List.copyOf(addresses);
        NameResolverRegistry.getDefaultRegistry().register(this);
    }

    static InetSocketAddress local(SidecarProcess p) {
        return new InetSocketAddress("127.0.0.1", p.grpcPort());
    }

    /** The target naming this resolver's addresses. */
    String target() {
        return scheme + ":///sidecar";
    }

    /** Seen by channels on their next resolution. */
    void setAddresses(List<InetSocketAddress> next) {
        this.addresses = List.copyOf(next);
    }

    @Override
    public NameResolver newNameResolver(URI targetUri, NameResolver.Args args) {
        if (!scheme.equals(targetUri.getScheme())) {
            return null;
        }
        return new NameResolver() {
            private Listener2 listener;

            @Override
            public String getServiceAuthority() {
                return "sidecar";
            }

            @Override
            public void start(Listener2 l) {
                listener = l;
                listeners.add(l);
                resolve();
            }

            @Override
            public void refresh() {
                resolve();
            }

            private void resolve() {
                resolutions.incrementAndGet();
                listener.onResult(ResolutionResult.newBuilder()
                        .setAddressesOrError(StatusOr.fromValue(
                                addresses.stream().map(EquivalentAddressGroup::new).toList()))
                        .setAttributes(Attributes.EMPTY).build());
            }

            @Override
            public void shutdown() {
                listeners.remove(listener);
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

    @Override
    public void close() {
        NameResolverRegistry.getDefaultRegistry().deregister(this);
    }
}
