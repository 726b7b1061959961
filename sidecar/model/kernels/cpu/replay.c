/* A recorded CPU decode step replayed as one call: the step's kernel calls, in order, with the arguments
 * they were recorded with (``replay.py``).
 *
 *   sidecar_replay(ops, n, base): calls ops[0..n) in order; returns 0, or i + 1 when op i (one whose result
 *                                 is checked) returned non-zero -- the ops after it are not run. An
 *                                 argument whose bit is set in its op's ``rel`` is an offset into the
 *                                 scratch arena at ``base`` (the step's intermediate tensors), added to it.
 *                                 An op whose kernel takes an argument struct holds a copy of it
 *                                 (``args``): the replay passes a copy of that, where the words whose bit
 *                                 is set in ``args_rel`` (pointers into the step's tensors, recorded as
 *                                 arena offsets) have ``base`` added.
 *
 * Every recorded kernel takes only integer-class arguments (pointers, int, int64) and float ones, at most
 * SIDECAR_REPLAY_INTS and SIDECAR_REPLAY_FLOATS of each, and returns an int or nothing. Each op is called
 * through one prototype with that many of each: under the x86-64 System V and Linux AArch64 calling
 * conventions integer-class and float arguments are assigned to their own register sequences in order,
 * and the integer ones past the registers go to the stack in order, one 8-byte slot each, so a kernel
 * reads its own arguments and ignores the rest (the caller clears them; an int reads the low half of its
 * slot). ``replay.py`` uses this executor on those platforms only, and the runner checks a replay
 * against the step run eagerly before it serves from replays.
 */
#include <stdint.h>

#define SIDECAR_REPLAY_INTS   20
#define SIDECAR_REPLAY_FLOATS 4
#define SIDECAR_REPLAY_WORDS  20 /* 8-byte words an argument struct may take */

typedef struct {
    void* fn;
    int64_t checked; /* 1: the kernel returns int, non-zero a failure; 0: its result is not read */
    int64_t rel;     /* bit i: a[i] is an offset into the arena */
    int64_t a[SIDECAR_REPLAY_INTS];
    float f[SIDECAR_REPLAY_FLOATS];
    int64_t args_at;  /* 0: no argument struct; else a[args_at - 1] is a pointer to the copy of args */
    int64_t args_rel; /* bit i: args[i] is an offset into the arena */
    int64_t args[SIDECAR_REPLAY_WORDS];
} sidecar_replay_op;

typedef int (*replay_fn)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t, float, float, float, float);

int sidecar_replay_ints(void) {
    return SIDECAR_REPLAY_INTS;
}
int sidecar_replay_floats(void) {
    return SIDECAR_REPLAY_FLOATS;
}
int sidecar_replay_words(void) {
    return SIDECAR_REPLAY_WORDS;
}
int sidecar_replay_op_size(void) {
    return (int)sizeof(sidecar_replay_op);
}

int sidecar_replay(const sidecar_replay_op* ops, int n, void* base) {
    for (int i = 0; i < n; i++) {
        const sidecar_replay_op* op = &ops[i];
        int64_t a[SIDECAR_REPLAY_INTS];
        for (int j = 0; j < SIDECAR_REPLAY_INTS; j++)
            a[j] = op->a[j] + (((op->rel >> j) & 1) ? (int64_t)(intptr_t)base : 0);
        int64_t args[SIDECAR_REPLAY_WORDS];
        if (op->args_at) {
            for (int j = 0; j < SIDECAR_REPLAY_WORDS; j++)
                args[j] = op->args[j] + (((op->args_rel >> j) & 1) ? (int64_t)(intptr_t)base : 0);
            a[op->args_at - 1] = (int64_t)(intptr_t)args;
        }
        const int rc = ((replay_fn)op->fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10],
                                           a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18], a[19],
                                           op->f[0], op->f[1], op->f[2], op->f[3]);
        if (op->checked && rc != 0) return i + 1;
    }
    return 0;
}
