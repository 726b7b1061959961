package dev.sidecar.client;

import io.grpc.ConnectivityState;
import io.grpc.ConnectivityStateInfo;
import io.grpc.EquivalentAddressGroup;
import io.grpc.LoadBalancer;
import io.grpc.Status;
import java.net.SocketAddress;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * Consistent hashing of a call's affinity key ({@link SessionAffinity}) over the READY replicas;
 * round-robin over them for a call without a key.
 *
 * <p>Each replica owns {@value #POINTS} points on a 64-bit ring, placed by hashing its address, so its
 * points do not depend on which other replicas exist: when a replica joins, leaves or stops being
 * READY, only the keys on the arcs it gains or loses move (about 1/N of the sessions). A key goes to
 * the first READY replica's point at or after the key's hash. All state changes run in the channel's
 * synchronization context; pickers are immutable snapshots.
 */
final class SessionAffinityLoadBalancer extends LoadBalancer {

    static final int POINTS = 160;

    private final Helper helper;
    // One subchannel per resolved address group, keyed by its addresses (attributes ignored).
    private final Map<List<SocketAddress>, Subchannel> subchannels = new LinkedHashMap<>();
    private final Map<Subchannel, ConnectivityStateInfo> states = new HashMap<>();
    private final AtomicInteger roundRobin = new AtomicInteger();
    private ConnectivityState current;

    SessionAffinityLoadBalancer(Helper helper) {
        this.helper = helper;
    }

    @Override
    public Status acceptResolvedAddresses(ResolvedAddresses resolved) {
        List<EquivalentAddressGroup> groups = resolved.getAddresses();
        if (groups.isEmpty()) {
            Status s = Status.UNAVAILABLE.withDescription("name resolved to no addresses");
            handleNameResolutionError(s);
            return s;
        }
        Set<List<SocketAddress>> wanted = new HashSet<>();
        for (EquivalentAddressGroup g : groups) {
            List<SocketAddress> key = g.getAddresses();
            wanted.add(key);
            if (!subchannels.containsKey(key)) {
                Subchannel sc = helper.createSubchannel(CreateSubchannelArgs.newBuilder()
                        .setAddresses(new EquivalentAddressGroup(key)).build());
                subchannels.put(key, sc);
                states.put(sc, ConnectivityStateInfo.forNonError(ConnectivityState.IDLE));
                sc.start(info -> onState(sc, info));
                sc.requestConnection();
            }
        }
        for (var it = subchannels.entrySet().iterator(); it.hasNext(); ) {
            var e = it.next();
            if (!wanted.contains(e.getKey())) {
                it.remove();
                states.remove(e.getValue());
                e.getValue().shutdown();
            }
        }
        publish();
        return Status.OK;
    }

    @Override
    public void handleNameResolutionError(Status error) {
        if (current != ConnectivityState.READY) {
            update(ConnectivityState.TRANSIENT_FAILURE, new Fail(error));
        }
    }

    @Override
    public void requestConnection() {
        for (Subchannel sc : subchannels.values()) {
            sc.requestConnection();
        }
    }

    @Override
    public void shutdown() {
        for (Subchannel sc : subchannels.values()) {
            sc.shutdown();
        }
        subchannels.clear();
        states.clear();
    }

    private void onState(Subchannel sc, ConnectivityStateInfo info) {
        if (!states.containsKey(sc) || info.getState() == ConnectivityState.SHUTDOWN) {
            return;
        }
        states.put(sc, info);
        if (info.getState() == ConnectivityState.IDLE) {
            sc.requestConnection();  // a dropped connection reconnects, so the replica can come back
        }
        publish();
    }

    private void publish() {
        List<Subchannel> ready = new ArrayList<>();
        boolean connecting = false;
        Status lastError = Status.UNAVAILABLE.withDescription("no READY replica");
        for (Subchannel sc : subchannels.values()) {
            ConnectivityStateInfo s = states.get(sc);
            switch (s.getState()) {
                case READY -> ready.add(sc);
                case CONNECTING, IDLE -> connecting = true;
                case TRANSIENT_FAILURE -> lastError = s.getStatus();
                default -> { }
            }
        }
        if (!ready.isEmpty()) {
            update(ConnectivityState.READY, new Ring(ready, roundRobin));
        } else if (connecting) {
            update(ConnectivityState.CONNECTING, new Fail(null));
        } else {
            update(ConnectivityState.TRANSIENT_FAILURE, new Fail(lastError));
        }
    }

    private void update(ConnectivityState state, SubchannelPicker picker) {
        current = state;
        helper.updateBalancingState(state, picker);
    }

    /** 64-bit FNV-1a with a final avalanche (splitmix64), so nearby keys spread over the ring. */
    static long hash(String s) {
        long h = 0xcbf29ce484222325L;
        for (byte b : s.getBytes(StandardCharsets.UTF_8)) {
            h ^= b & 0xff;
            h *= 0x100000001b3L;
        }
        h ^= h >>> 30;
        h *= 0xbf58476d1ce4e5b9L;
        h ^= h >>> 27;
        h *= 0x94d049bb133111ebL;
        return h ^ (h >>> 31);
    }

    /** Picks for a snapshot of READY replicas. */
    static final class Ring extends SubchannelPicker {
        private final TreeMap<Long, Subchannel> ring = new TreeMap<>();
        private final List<Subchannel> ready;
        private final AtomicInteger next;

        Ring(List<Subchannel> ready, AtomicInteger next) {
            this.ready = ready;
            this.next = next;
            for (Subchannel sc : ready) {
                String id = sc.getAddresses().getAddresses().toString();
                for (int i = 0; i < POINTS; i++) {
                    ring.put(hash(id + "#" + i), sc);
                }
            }
        }

        @Override
        public PickResult pickSubchannel(PickSubchannelArgs args) {
            String key = args.getCallOptions().getOption(SessionAffinity.CALL_OPTION);
            if (key == null) {
                key = args.getHeaders().get(SessionAffinity.HEADER);
            }
            if (key == null) {
                return PickResult.withSubchannel(ready.get(Math.floorMod(next.getAndIncrement(), ready.size())));
            }
            var e = ring.ceilingEntry(hash(key));
            return PickResult.withSubchannel((e != null ? e : ring.firstEntry()).getValue());
        }
    }

    /** No READY replica: wait while one connects ({@code error == null}), else fail the pick. */
    static final class Fail extends SubchannelPicker {
        private final Status error;

        Fail(Status error) {
            this.error = error;
        }

        @Override
        public PickResult pickSubchannel(PickSubchannelArgs args) {
            return error == null ? PickResult.withNoResult() : PickResult.withError(error);
        }
    }
}
