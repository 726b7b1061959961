"""Compiles every Triton kernel of the model for a real GPU target (front end, LLVM and ptxas), no GPU needed.

The interpreter runs kernels as numpy and lets through what a GPU compile refuses (a dot under 16, a type
mixed across branches, an op the backend lacks). Run in a fresh process without ``TRITON_INTERPRET``:
``python compile_kernels.py 90`` prints one line per kernel and exits non-zero on the first failure.
"""

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sidecar.model.kernels.triton import wo as triton_wo  # noqa: E402
from sidecar.model.kernels.triton import attention as triton_attention, gemv as triton_gemv, ops as triton_ops
from sidecar.model.kernels.triton import attention_scores as triton_scores  # noqa: E402
from sidecar.model.kernels.triton import moe as triton_moe  # noqa: E402
from sidecar.model.kernels.triton import deltanet as triton_deltanet  # noqa: E402


def build(fn, args: dict, constexprs: dict, arch: int, warps: int = 4) -> None:
    """``args``: name -> Triton type string ("*bf16", "i32", ...), in the kernel's order; ``warps``: the
    launch's ``num_warps``."""
    given = dict(args, **{k: "constexpr" for k in constexprs})
    names = list(fn.arg_names)  # the signature goes by position: the kernel's own order
    assert set(names) == set(given), f"{fn.__name__}: {sorted(set(names) ^ set(given))}"
    sig = {n: given[n] for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def ints(names: str) -> dict:
    return {n: "i32" for n in names.split()}


def main(arch: int) -> None:
    for dt in ("bf16", "fp32"):
        f32, bf16 = dt == "fp32", dt == "bf16"
        p = f"*{dt}"
        # Plain cache; int8 codes; fp8 e4m3 codes (passed as bytes). Scales are float32.
        for group, direct, window, codes in (
            (1, True, False, None),
            (7, False, True, None),
            (3, True, False, "*i8"),
            (7, False, True, "*u8"),
        ):
            kv = codes or p
            build(
                triton_attention._decode_partition,
                dict(
                    q_ptr=p,
                    k_ptr=kv,
                    v_ptr=kv,
                    ks_ptr="*fp32" if codes else p,
                    vs_ptr="*fp32" if codes else p,
                    bt_ptr="*i32",
                    ctx_ptr="*i64",
                    out_ptr=p,
                    m_ptr="*fp32",
                    l_ptr="*fp32",
                    acc_ptr="*fp32",
                    lse_ptr="*fp32",
                    scale="fp32",
                    window="i32",
                    softcap="fp32",
                    **ints(
                        "s_qb s_qh s_kb s_ks s_kh s_vb s_vs s_vh s_sb s_ss s_bt s_ob s_oh n_parts max_blocks"
                    ),
                ),
                dict(
                    GROUP=group,
                    G_PAD=16,
                    HEAD_DIM=64,
                    D_PAD=64,
                    BLOCK_SIZE=16,
                    PART=256,
                    BLOCK_N=32,
                    HAS_WINDOW=window,
                    SOFTCAP=window,  # soft-capped scores (Gemma 2) in the windowed variants, uncapped in the others
                    DIRECT=direct,
                    LSE=window,  # the log-sum-exp kept for scored eviction in the windowed variants
                    F32=f32,
                    BF16=bf16,
                    QUANT=codes is not None,
                    FP8=codes == "*u8",
                ),
                arch,
            )
        build(
            triton_attention._decode_reduce,
            dict(
                m_ptr="*fp32",
                l_ptr="*fp32",
                acc_ptr="*fp32",
                out_ptr=p,
                lse_ptr="*fp32",
                **ints("n_parts s_ob s_oh"),
            ),
            dict(HEAD_DIM=64, D_PAD=64, P_PAD=8, LSE=True, BF16=bf16),
            arch,
        )
        for group, window, codes in ((1, False, None), (7, True, "*i8"), (3, True, "*u8")):
            kv = codes or p
            build(
                triton_scores._decode_scores,
                dict(
                    q_ptr=p,
                    k_ptr=kv,
                    ks_ptr="*fp32" if codes else p,
                    bt_ptr="*i32",
                    ctx_ptr="*i64",
                    lse_ptr="*fp32",
                    sc_ptr="*fp32",
                    scale="fp32",
                    window="i32",
                    softcap="fp32",
                    **ints("s_qb s_qh s_kb s_ks s_kh s_sb s_ss s_bt max_blocks"),
                ),
                dict(
                    QUANT=codes is not None,
                    FP8=codes == "*u8",
                    GROUP=group,
                    G_PAD=16,
                    HEAD_DIM=64,
                    D_PAD=64,
                    BLOCK_SIZE=16,
                    PART=256,
                    BLOCK_N=32,
                    HAS_WINDOW=window,
                    SOFTCAP=window,
                    F32=f32,
                    BF16=bf16,
                ),
                arch,
            )
        # The grouped expert GEMM: silu, GeGLU and gpt-oss's clamped SwiGLU with biases (also over MXFP4 codes
        # and their scales); Llama 4's scaled input.
        for act, bias, scale_in, mx in (
            (0, False, False, False),
            (1, False, False, False),
            (2, True, False, False),
            (0, False, True, False),
            (2, True, False, True),
        ):
            w, ws = ("*u8", "*u8") if mx else (p, p)
            build(
                triton_moe._gate_up,
                dict(
                    x_ptr=p,
                    rows_ptr="*i32",
                    te_ptr="*i32",
                    w_ptr=w,
                    s_ptr=ws,
                    b_ptr=p,
                    rw_ptr="*fp32",
                    out_ptr=p,
                    limit="fp32",
                    alpha="fp32",
                    **ints("h inter top_k"),
                ),
                dict(
                    BLOCK_M=16,
                    BLOCK_N=64,
                    BLOCK_K=64,
                    ACT=act,
                    HAS_BIAS=bias,
                    SCALE_IN=scale_in,
                    MX=mx,
                    F32=f32,
                    BF16=bf16,
                ),
                arch,
            )
            build(
                triton_moe._down,
                dict(
                    a_ptr=p,
                    rows_ptr="*i32",
                    te_ptr="*i32",
                    w_ptr=w,
                    s_ptr=ws,
                    b_ptr=p,
                    rw_ptr="*fp32",
                    out_ptr="*fp32" if not scale_in else p,
                    **ints("h inter"),
                ),
                dict(
                    BLOCK_M=16,
                    BLOCK_N=64,
                    BLOCK_K=64,
                    HAS_BIAS=bias,
                    SCALE_OUT=not scale_in,
                    MX=mx,
                    F32=f32,
                    BF16=bf16,
                    OUT_BF16=bf16 and scale_in,
                ),
                arch,
            )
        for codes in (
            None,
            "*i8",
            "*u8",
        ):  # plain cache; int8 codes; fp8 e4m3 codes as bytes (+ float32 scales)
            c, sc = (codes, "*fp32") if codes else (p, p)
            build(
                triton_ops._rope_kv,
                dict(
                    qkv_ptr=p,
                    cos_ptr=p,
                    sin_ptr=p,
                    slot_ptr="*i64",
                    kc_ptr=c,
                    vc_ptr=c,
                    ks_ptr=sc,
                    vs_ptr=sc,
                    q_ptr=p,
                    k_ptr=p,
                    **ints("s_qkv s_kc_slot"),
                ),
                dict(
                    NH=14,
                    NKV=2,
                    HD=64,
                    D_PAD=64,
                    WANT_K=True,
                    QUANT=codes is not None,
                    FP8=codes == "*u8",
                    BF16=bf16,
                ),
                arch,
            )
        build(
            triton_ops._add_rms_norm,
            dict(h_ptr=p, d_ptr=p, w_ptr=p, s_ptr=p, out_ptr=p, dim="i32", eps="fp32"),
            dict(HAS_DELTA=True, BLOCK=1024, BF16=bf16),
            arch,
        )
        build(triton_ops._silu_mul, dict(gu_ptr=p, out_ptr=p, inter="i32"), dict(BLOCK=1024, BF16=bf16), arch)
        for split in (1, 4):  # the whole K in one program; ranges of K into float32 partials
            tiles = dict(BLOCK_M=16, BLOCK_N=32, F32=f32, BF16=bf16, SPLIT=split)
            build(
                triton_wo._int8_mm,
                dict(
                    x_ptr=p,
                    w_ptr="*i8",
                    s_ptr="*fp32",
                    y_ptr=p,
                    p_ptr="*fp32",
                    **ints("m n k k_per s_xm s_wn s_ym"),
                ),
                dict(tiles, BLOCK_K=128),
                arch,
            )
            for block_k in (32, 128):
                build(
                    triton_wo._int4_mm,
                    dict(
                        x_ptr=p,
                        q_ptr="*u8",
                        sz_ptr="*bf16",
                        y_ptr=p,
                        p_ptr="*fp32",
                        **ints("m n k k_per s_xm s_qn s_ym group_size"),
                    ),
                    dict(tiles, BLOCK_K=block_k),
                    arch,
                )
            build(
                triton_wo._sum_parts,
                dict(p_ptr="*fp32", s_ptr="*fp32", y_ptr=p, **ints("m n s_ym")),
                dict(SPLIT=split, SCALE=True, BLOCK=256, BF16=bf16),
                arch,
            )
        # A layer's fused products: plain (o), add + norm before (qkv, gate/up), silu * up before (down).
        for pro, block_n, block_k, one_step in (
            (0, 2, 1024, True),
            (1, 8, 1024, True),
            (1, 4, 512, False),
            (2, 4, 1024, False),
        ):
            build(
                triton_gemv._gemv,
                dict(
                    x_ptr=p, d_ptr=p, nw_ptr=p, s_ptr=p, w_ptr=p, b_ptr=p, y_ptr=p, eps="fp32", **ints("n k")
                ),
                dict(
                    PRO=pro,
                    HAS_DELTA=pro == 1,
                    HAS_BIAS=pro != 2,
                    BLOCK_N=block_n,
                    BLOCK_K=block_k,
                    ONE_STEP=one_step,
                    BF16=bf16,
                ),
                arch,
            )
        # A gated DeltaNet decode step: the convolution (Qwen3.5's 4 taps; 2), the rule at Qwen3.5's heads
        # (128 x 128 state tiles, eight warps) and at small ones.
        for kernel in (4, 2):
            build(
                triton_deltanet._conv,
                dict(proj_ptr=p, win_ptr=p, w_ptr=p, slots_ptr="*i64", y_ptr=p, **ints("ld conv_dim nslots")),
                dict(KERNEL=kernel, BLOCK=triton_deltanet.CONV_BLOCK, BF16=bf16),
                arch,
            )
        for block_k, block_v, warps in ((128, 128, 8), (16, 32, 4)):
            build(
                triton_deltanet._rule,
                dict(
                    y_ptr=p,
                    proj_ptr=p,
                    b_ptr=p,
                    a_ptr=p,
                    A_ptr="*fp32",
                    dt_ptr=p,
                    nw_ptr=p,
                    state_ptr="*fp32",
                    slots_ptr="*i64",
                    out_ptr=p,
                    eps="fp32",
                    **ints("ld nk nv dk dv nslots"),
                ),
                dict(BLOCK_K=block_k, BLOCK_V=block_v, BF16=bf16),
                arch,
                warps,
            )
        print(f"sm_{arch} {dt}: every kernel compiles")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
