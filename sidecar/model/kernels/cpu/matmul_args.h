/* The argument struct of every matrix product entry point (bf16_gemv.c, amx_gemm.c, int4_gemv.c,
 * int8_gemv.c, int8_gemm.c), mirrored by ``matmul_args.MatmulArgs``: y = x @ w.T (times the weight's scales)
 * + bias. Each kernel reads the fields its doc comment names and ignores the rest. */
#ifndef SIDECAR_MATMUL_ARGS_H
#define SIDECAR_MATMUL_ARGS_H

typedef struct {
    const void* x;      /* activations [M, K]: bf16, or float32 where x_bf16 is 0 and the kernel takes it */
    const void* w;      /* the weight in the kernel's layout */
    const void* scales; /* int8: float32 [N] or [N, K / 32]; int4: bf16 scales and zeros [K / gs, N, 2] */
    const void* bias;   /* [N], bf16 where bias_bf16 else float32, or NULL */
    void* y;            /* output [M, N] */
    int M, N, K;        /* N: output columns (a gate/up product: its gate rows, half the weight's) */
    int nthreads;
    int x_bf16;     /* 1: x is bf16 (else float32) */
    int bias_bf16;  /* 1: bias is bf16 (else float32) */
    int out;        /* 0 float32, 1 bf16 (rounded once), 2 float32 of the bf16-rounded values (tile layout) */
    int group_size; /* int4: values a scale covers */
    int block_n;    /* int4: rows a block of torch's packed layout holds (32 or 64) */
    int split;      /* int4: 1 where a block's nibbles split low rows / high rows (else interleaved) */
    int grouped;    /* int8: scales one per 32 values of a row (llama.cpp's Q8_0) instead of one per row */
    int silu;       /* gate/up: silu(gate) * up instead of both */
} sidecar_matmul_args;

/* Checked against the mirror when a library is loaded (each library is one translation unit). */
int sidecar_matmul_args_size(void) {
    return (int)sizeof(sidecar_matmul_args);
}

#endif
