"""The probe behind G9 (perf/2026-11-27-h100.md), kept as it ran: on a CUDA machine, from the repository root,
``PYTHONPATH=. [SWEEP=lite] python3 docs/perf/h100-gemv-probe.py`` writes ``$OUT/gemv_probe.json`` (default /tmp).

A layer's one-row products with the fused kernels (``triton_gemv``) against cuBLAS + the separate norm and silu
kernels, over 24 layers' weights in one CUDA graph (attention left out); each product alone over a sweep of
configurations against cuBLAS; then the engine's batch-1 decode rate with the ``gemv`` path on and off (graphs
recaptured), and a profile of a 17-token generation."""
import json, os, sys, time
import torch, triton
import torch.nn.functional as F
from sidecar.model.kernels.triton import gemv as G, ops as O

OUT = os.environ.get("OUT", "/tmp")
dev, dt = "cuda", torch.bfloat16
H, I, NQKV, L, EPS = 896, 4864, 1152, 24, 1e-6
res = {"device": torch.cuda.get_device_name(0), "sms": torch.cuda.get_device_properties(0).multi_processor_count}
torch.manual_seed(0)
r = lambda *s: (torch.randn(*s, device=dev) * 0.02).to(dt)
layers = [dict(qkv=r(NQKV, H), qb=r(NQKV), o=r(H, H), gu=r(2 * I, H), down=r(H, I),
               n1=(1 + r(H)).contiguous(), n2=(1 + r(H)).contiguous()) for _ in range(L)]


def timed_graph(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    best = 1e9
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record(); torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / reps)
    return best


INPUTS = {m: (r(m, H) * 50, r(m, H) * 50, r(m, H) * 50) for m in (1,)}


def seq(m, fused):
    h0, d0, att = INPUTS[m]
    outs = {}
    def run():
        h, delta = h0, d0
        for lw in layers:
            if fused:
                qkv, h = G.norm_matmul(h, delta, lw["n1"], EPS, lw["qkv"], lw["qb"])
                o = G.matmul(att, lw["o"])
                gu, h = G.norm_matmul(h, o, lw["n2"], EPS, lw["gu"])
                delta = G.silu_matmul(gu, lw["down"])
            else:
                x, h = O.add_rms_norm(h, delta, lw["n1"], EPS)
                qkv = F.linear(x, lw["qkv"], lw["qb"])
                o = F.linear(att, lw["o"])
                x, h = O.add_rms_norm(h, o, lw["n2"], EPS)
                delta = F.linear(O.silu_mul(F.linear(x, lw["gu"])), lw["down"])
        outs["h"], outs["d"], outs["qkv"] = h, delta, qkv
    return run, outs


for m in (1,):
    row = {}
    for fused in (False, True):
        run, outs = seq(m, fused)
        row["fused" if fused else "unfused"] = timed_graph(run) / L
        row[("f" if fused else "u") + "_out"] = [outs["d"].float().clone(), outs["qkv"].float().clone()]
    u, f = row.pop("u_out"), row.pop("f_out")
    row["rel_err_out"] = float((u[0] - f[0]).norm() / u[0].norm())
    row["rel_err_qkv"] = float((u[1] - f[1]).norm() / u[1].norm())
    res[f"layer_us_m{m}"] = row
    print("rows", m, row, flush=True)

# Sweep: each product alone over the 24 layers' weights, one row.
shapes = {"qkv": ("qkv", 1, NQKV, H, "qb"), "o": ("o", 0, H, H, None), "gate_up": ("gu", 1, 2 * I, H, None),
          "down": ("down", 2, H, I, None)}
sweep = {}
for name, (key, pro, n, k, bkey) in shapes.items():
    x = r(1, 2 * k if pro == 2 else k) * 50
    d = r(1, k) * 50
    s_ = torch.empty(1, k, device=dev, dtype=dt)
    y = torch.empty(1, n, device=dev, dtype=dt)
    res_cfg = {}
    heur = G.config(n, k, res["sms"])
    cands = [(bn, bk, w) for bn in (2, 4, 8, 16) for bk in (512, 1024, 2048) for w in (4, 8)
             if 2048 <= bn * bk <= 16384]
    cands = list(dict.fromkeys([heur] + cands))
    if os.environ.get("SWEEP") == "lite":
        cands = [heur, (heur[0], 512, heur[2]), (heur[0] * 2 if heur[0] < 8 else 4, heur[1], heur[2])]
    for bn, bk, w in cands:
        def run(bn=bn, bk=bk, w=w):
            for lw in layers:
                G._gemv[(triton.cdiv(n, bn),)](x, d, lw["n1"] if pro == 1 else x, s_, lw[key],
                                               lw[bkey] if bkey else lw[key], y, n, k, EPS,
                                               PRO=pro, HAS_DELTA=pro == 1, HAS_BIAS=bkey is not None,
                                               BLOCK_N=bn, BLOCK_K=bk, ONE_STEP=k <= bk, BF16=True, num_warps=w,
                                               enable_fp_fusion=False)
        try:
            res_cfg[f"{bn},{bk},{w}"] = round(timed_graph(run, 10) / L, 2)
        except Exception as e:
            res_cfg[f"{bn},{bk},{w}"] = str(e)[:80]
    wt = [lw[key] for lw in layers]
    xin = x[:, :k].contiguous()
    def cub():
        for w_ in wt:
            F.linear(xin, w_)
    best = sorted((v, c) for c, v in res_cfg.items() if isinstance(v, float))[:5]
    sweep[name] = {"cublas_us": round(timed_graph(cub, 10) / L, 2), "heuristic": "%d,%d,%d" % heur,
                   "heuristic_us": res_cfg.get("%d,%d,%d" % heur), "best5": best, "all": res_cfg}
    print(name, {k_: v for k_, v in sweep[name].items() if k_ != "all"}, flush=True)
res["sweep"] = sweep

# Batch-1 decode through the engine, the fused path on (as the self-check leaves it) and off.
from sidecar import LLM, SamplingParams
from sidecar.bench.models import random_checkpoint
path = random_checkpoint("qwen2-0.5b")
llm = LLM(model=str(path), dtype="auto", device="cuda", max_num_seqs=64, kv_cache_memory_gb=2.0)
info = llm.engine.model_info
res["fast_paths"], res["fallbacks"] = info["fast_paths"], info["fast_path_fallbacks"]
print("paths", res["fast_paths"], res["fallbacks"], flush=True)
prompt = list(range(100, 132))
def b1(n=129):
    rates = []
    for _ in range(3):
        o = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        rates.append((n - 1) / (o.e2e_s - o.ttft_s))
    return max(rates), o.token_ids
runner = llm.engine.runner
on, toks_on = b1()
runner.fast_paths.gemv = False
runner.capture_graphs()
off, toks_off = b1()
runner.fast_paths.gemv = "gemv" in res["fast_paths"]
runner.capture_graphs()
on2, _ = b1()
res["b1"] = {"gemv_on": on, "gemv_off": off, "gemv_on_again": on2,
             "same_tokens": sum(a == b for a, b in zip(toks_on, toks_off)), "of": len(toks_on)}
print("b1", res["b1"], flush=True)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    llm.generate([prompt], SamplingParams(max_tokens=17, ignore_eos=True))
torch.cuda.synchronize()
kern = {}
for e in prof.events():
    if e.device_type.name == "CUDA":
        kname = e.name[:60]
        t, c = kern.get(kname, (0.0, 0))
        kern[kname] = (t + e.device_time_total if hasattr(e, "device_time_total") else t + e.cuda_time_total, c + 1)
top = sorted(kern.items(), key=lambda kv: -kv[1][0])[:16]
res["profile_17_tokens"] = [(k_, round(t, 1), c) for k_, (t, c) in top]
for row in res["profile_17_tokens"]:
    print("prof", row, flush=True)
json.dump(res, open(os.path.join(OUT, "gemv_probe.json"), "w"), indent=1)
