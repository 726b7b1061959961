/* All-reduce (sum) between the CPU ranks of one host through one shared-memory segment.
 *
 * Segment layout (rank 0 creates it, every other rank maps it by name):
 *   header   magic, world, slot size, the abort flag, each rank's pid (written at attach);
 *   flags    one cache line per rank: `arrived` (the sequence number of the chunk whose partial this rank has
 *            written into its slot) and `count` (each buffer's chunk's element count, to catch ranks out of
 * step); data     two buffers of `world` slots of `slot_bytes` each.
 *
 * A call sums `n` elements in chunks of at most one slot. Each chunk takes the next sequence number s (every
 * rank counts alike, since every rank makes the same calls in the same order) and buffer s % 2: the rank
 * copies its part into its slot, release-stores arrived = s, waits (acquire) until every rank's arrived >= s,
 * then sums the slots of ranks 0, 1, ..., N-1 in that order into its own tensor. Every rank runs the same
 * additions in the same order on the same values, so every rank gets the same bits; bf16 is summed in float32
 * and rounded once to nearest even (as torch rounds). Two buffers make one wait per chunk enough: a rank that
 * writes buffer s % 2 has seen every rank arrive at s - 1, and a rank arrives at s - 1 only after it has
 * finished reading the slots of s - 2, the last chunk that used the buffer.
 *
 * Waiting spins briefly, then yields the core; it ends with an error code (never a hang) when the timeout
 * runs out, when a peer process has exited (pidfd, polled between yields), or when any rank has aborted the
 * group. Every error sets the abort flag, so the other ranks' waits end at once too: after an error the
 * segment is dead for good. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAGIC     0x5344435348415231ull /* "SDCSHAR1" */
#define MAX_RANKS 64
#define LINE      64
#define SPINS     4096 /* busy polls before the first yield */
#define PROBE     256  /* yields between clock / peer checks */

enum { OK = 0, TIMED_OUT = 1, PEER_EXITED = 2, ABORTED = 3, BAD_ARGS = 4, OUT_OF_STEP = 5 };

typedef struct {
    uint64_t magic;
    int32_t world;
    int32_t pad;
    int64_t slot_bytes;
    int32_t abort_flag; /* atomic */
    int32_t pids[MAX_RANKS];
} header;

typedef struct {
    uint64_t arrived; /* atomic */
    int64_t count[2]; /* by the chunk's buffer: a rank may write the next chunk's while a peer reads this
                         one's */
    char pad[LINE - 24];
} flag;

typedef struct {
    char* base;
    size_t bytes;
    header* head;
    flag* flags;
    char* data;
    int rank, world;
    int64_t slot_bytes;
    uint64_t seq;
    int pidfds[MAX_RANKS];
} handle;

static size_t head_bytes(void) {
    return (sizeof(header) + LINE - 1) / LINE * LINE;
}

static size_t total_bytes(int world, int64_t slot_bytes) {
    return head_bytes() + (size_t)world * LINE + 2 * (size_t)world * (size_t)slot_bytes;
}

static handle* wrap(char* base, size_t bytes, int rank, int world, int64_t slot_bytes) {
    handle* h = calloc(1, sizeof(handle));
    if (!h) return NULL;
    h->base = base;
    h->bytes = bytes;
    h->head = (header*)base;
    h->flags = (flag*)(base + head_bytes());
    h->data = base + head_bytes() + (size_t)world * LINE;
    h->rank = rank;
    h->world = world;
    h->slot_bytes = slot_bytes;
    for (int r = 0; r < MAX_RANKS; r++) h->pidfds[r] = -1;
    __atomic_store_n(&h->head->pids[rank], (int32_t)getpid(), __ATOMIC_RELEASE);
    return h;
}

/* Rank 0: create segment `name` (which must not exist) for `world` ranks and map it; NULL on failure (errno
 * set). Its pages are reserved up front, so a full /dev/shm fails here, not as a fault at first touch. */
static void* create(const char* name, int world, int64_t slot_bytes) {
    if (world < 1 || world > MAX_RANKS || slot_bytes < 64 || slot_bytes % 64) {
        errno = EINVAL;
        return NULL;
    }
    const size_t bytes = total_bytes(world, slot_bytes);
    const int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return NULL;
    int err = posix_fallocate(fd, 0, (off_t)bytes);
    char* base = MAP_FAILED;
    if (!err)
        base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    else
        errno = err;
    close(fd);
    if (base == MAP_FAILED) {
        shm_unlink(name);
        return NULL;
    }
    memset(base, 0, head_bytes() + (size_t)world * LINE);
    header* head = (header*)base;
    head->world = world;
    head->slot_bytes = slot_bytes;
    __atomic_store_n(&head->magic, MAGIC, __ATOMIC_RELEASE);
    handle* h = wrap(base, bytes, 0, world, slot_bytes);
    if (!h) {
        munmap(base, bytes);
        shm_unlink(name);
    }
    return h;
}

/* Rank `rank` of `world`: map the segment rank 0 created; NULL when it is missing or not one for `world`. */
static void* attach(const char* name, int rank, int world) {
    if (world < 1 || world > MAX_RANKS || rank < 0 || rank >= world) {
        errno = EINVAL;
        return NULL;
    }
    const int fd = shm_open(name, O_RDWR, 0600);
    if (fd < 0) return NULL;
    struct stat st;
    char* base = MAP_FAILED;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(header))
        base = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) return NULL;
    const header* head = (const header*)base;
    if (__atomic_load_n(&head->magic, __ATOMIC_ACQUIRE) != MAGIC || head->world != world ||
        (size_t)st.st_size != total_bytes(world, head->slot_bytes)) {
        munmap(base, (size_t)st.st_size);
        errno = EINVAL;
        return NULL;
    }
    handle* h = wrap(base, (size_t)st.st_size, rank, world, head->slot_bytes);
    if (!h) munmap(base, (size_t)st.st_size);
    return h;
}

/* errno of the calling thread's last failed create / attach */
static __thread int last_errno;

int sidecar_shm_errno(void) {
    return last_errno;
}

int sidecar_shm_unlink(const char* name) {
    return shm_unlink(name) == 0 ? 0 : errno;
}

void* sidecar_shm_create(const char* name, int world, int64_t slot_bytes) {
    void* h = create(name, world, slot_bytes);
    last_errno = h ? 0 : errno;
    return h;
}

void* sidecar_shm_attach(const char* name, int rank, int world) {
    void* h = attach(name, rank, world);
    last_errno = h ? 0 : errno;
    return h;
}

/* End the group: every rank's wait, present or next, returns ABORTED. */
void sidecar_shm_abort(void* hp) {
    handle* h = hp;
    __atomic_store_n(&h->head->abort_flag, 1, __ATOMIC_RELEASE);
}

void sidecar_shm_close(void* hp) {
    handle* h = hp;
    for (int r = 0; r < MAX_RANKS; r++)
        if (h->pidfds[r] >= 0) close(h->pidfds[r]);
    munmap(h->base, h->bytes);
    free(h);
}

int64_t sidecar_shm_slot_bytes(void* hp) {
    return ((handle*)hp)->slot_bytes;
}

/* 1 once a peer process has exited. A peer's pidfd is opened at its first check after its pid is known; where
 * pidfds are not available, a pid no longer there (ESRCH) is the sign, and the timeout covers the rest. */
static int peer_exited(handle* h) {
    for (int r = 0; r < h->world; r++) {
        if (r == h->rank) continue;
        const int32_t pid = __atomic_load_n(&h->head->pids[r], __ATOMIC_ACQUIRE);
        if (pid <= 0) continue;
#ifdef SYS_pidfd_open
        if (h->pidfds[r] == -1) {
            const long fd = syscall(SYS_pidfd_open, (pid_t)pid, 0);
            h->pidfds[r] = fd >= 0 ? (int)fd : (errno == ESRCH ? -3 : -2);
        }
        if (h->pidfds[r] == -3) return 1;
        if (h->pidfds[r] >= 0) {
            struct pollfd p = {h->pidfds[r], POLLIN, 0};
            if (poll(&p, 1, 0) > 0) return 1;
            continue;
        }
#endif
        if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return 1;
    }
    return 0;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int fail(handle* h, int code) {
    sidecar_shm_abort(h);
    return code;
}

static int wait_all(handle* h, uint64_t seq, int64_t count, int64_t deadline) {
    for (int r = 0; r < h->world; r++) {
        uint64_t polls = 0;
        while (__atomic_load_n(&h->flags[r].arrived, __ATOMIC_ACQUIRE) < seq) {
            if (__atomic_load_n(&h->head->abort_flag, __ATOMIC_ACQUIRE)) return ABORTED;
            if (++polls < SPINS) {
                __builtin_ia32_pause();
                continue;
            }
            sched_yield();
            if (polls % PROBE == 0) {
                if (now_ns() > deadline) return fail(h, TIMED_OUT);
                if (peer_exited(h)) return fail(h, PEER_EXITED);
            }
        }
        if (h->flags[r].count[seq & 1] != count) return fail(h, OUT_OF_STEP);
    }
    return OK;
}

static inline float bf16_to_f32(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN to torch's quiet NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* out[i] = slot 0 + slot 1 + ... + slot N-1 (in that order) for i in [lo, hi) */
static void sum_f32(float* out, char* const* slots, int world, int64_t lo, int64_t hi) {
    const float* s0 = (const float*)slots[0];
    for (int64_t i = lo; i < hi; i++) out[i] = s0[i];
    for (int r = 1; r < world; r++) {
        const float* s = (const float*)slots[r];
        for (int64_t i = lo; i < hi; i++) out[i] += s[i];
    }
}

static void sum_bf16(uint16_t* out, char* const* slots, int world, int64_t lo, int64_t hi) {
    float acc[256];
    for (int64_t i0 = lo; i0 < hi; i0 += 256) {
        const int64_t m = hi - i0 < 256 ? hi - i0 : 256;
        const uint16_t* s0 = (const uint16_t*)slots[0] + i0;
        for (int64_t i = 0; i < m; i++) acc[i] = bf16_to_f32(s0[i]);
        for (int r = 1; r < world; r++) {
            const uint16_t* s = (const uint16_t*)slots[r] + i0;
            for (int64_t i = 0; i < m; i++) acc[i] += bf16_to_f32(s[i]);
        }
        for (int64_t i = 0; i < m; i++) out[i0 + i] = f32_to_bf16(acc[i]);
    }
}

/* Sum `n` elements at `data` (dtype 0: float32, 1: bf16) over the ranks, in place. Returns OK, or an error
 * code (TIMED_OUT after `timeout_ms` of waiting for one chunk, PEER_EXITED, ABORTED, OUT_OF_STEP when the
 * ranks' counts differ, BAD_ARGS) after which the segment is aborted. Splits the sum over `nthreads` threads
 * when it is large (each element's additions are the same whatever thread makes them). */
int sidecar_shm_all_reduce(void* hp, void* data, int64_t n, int dtype, int64_t timeout_ms, int nthreads) {
    handle* h = hp;
    if (!h || n < 0 || (dtype != 0 && dtype != 1) || (n > 0 && !data)) return BAD_ARGS;
    if (__atomic_load_n(&h->head->abort_flag, __ATOMIC_ACQUIRE)) return ABORTED;
    const int64_t esize = dtype == 0 ? 4 : 2;
    const int64_t per = h->slot_bytes / esize;
    if (nthreads < 1) nthreads = 1;
    char* slots[MAX_RANKS];
    for (int64_t at = 0; at < n; at += per) {
        const int64_t m = n - at < per ? n - at : per;
        const uint64_t seq = ++h->seq;
        char* buf = h->data + (size_t)(seq & 1) * (size_t)h->world * (size_t)h->slot_bytes;
        for (int r = 0; r < h->world; r++) slots[r] = buf + (size_t)r * (size_t)h->slot_bytes;
        char* mine = (char*)data + at * esize;
        memcpy(slots[h->rank], mine, (size_t)(m * esize));
        h->flags[h->rank].count[seq & 1] = m;
        __atomic_store_n(&h->flags[h->rank].arrived, seq, __ATOMIC_RELEASE);
        const int rc = wait_all(h, seq, m, now_ns() + timeout_ms * 1000000);
        if (rc != OK) return rc;
        const int threads = m >= (1 << 16) ? nthreads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int t = 0; t < threads; t++) {
            const int64_t lo = m * t / threads, hi = m * (t + 1) / threads;
            if (dtype == 0)
                sum_f32((float*)mine, slots, h->world, lo, hi);
            else
                sum_bf16((uint16_t*)mine, slots, h->world, lo, hi);
        }
    }
    return OK;
}
