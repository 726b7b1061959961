"""Writes a LoRA adapter (PEFT format, random weights) for the demo model into argv[1] and prints, as the
lines ``base=<answer>`` and ``support=<answer>``: the greedy chat answers to argv[2] (at most argv[3] tokens)
of the base model and of the adapter as the offline engine gives them, UTF-8 in base64."""
import base64
import sys
from pathlib import Path

from sidecar import LLM, SamplingParams
from sidecar.bench.lora import write_adapter

out, question, max_tokens = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
probe = LLM(model="demo", device="cpu", num_kv_blocks=64)
info = probe.engine.model_info
write_adapter(out, info["lora_target_shapes"], info["num_layers"], rank=8, seed=7, b_std=0.5)
llm = LLM(model="demo", device="cpu", num_kv_blocks=64, lora_modules={"support": str(out)}, max_lora_rank=8)
params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
chat = [{"role": "user", "content": question}]
for name, lora in (("base", None), ("support", "support")):
    text = llm.chat(chat, params, lora=lora)[0].text
    print(f"{name}={base64.b64encode(text.encode('utf-8')).decode('ascii')}")
