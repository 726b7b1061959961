package dev.sidecar.it;

/** Sidecar flags shared by the integration tests (same flags = same shared process). */
final class ItArgs {

    /** A small, exact KV pool keeps memory low and makes "all blocks free" checks exact. */
    static final int NUM_KV_BLOCKS = 512;

    static final String[] DEFAULT = {"--num-kv-blocks", String.valueOf(NUM_KV_BLOCKS)};

    /** The trained default model (SmolLM2-135M-Instruct), for tests that assert on what the answer says. */
    static final String[] REAL_MODEL = {"--model", "SmolLM2-135M-Instruct",
            "--num-kv-blocks", String.valueOf(NUM_KV_BLOCKS)};

    /** One request per 5 s per caller, burst 1: the second immediate call is rate limited. */
    static final String[] RATE_LIMITED = {"--num-kv-blocks", String.valueOf(NUM_KV_BLOCKS),
            "--rate-limit-rps", "0.2", "--rate-limit-burst", "1"};

    private ItArgs() {
    }
}
