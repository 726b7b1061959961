"""Adapters for the LoRA tests, made with ``peft`` on the tiny checkpoints, and the HF + PEFT reference."""

from __future__ import annotations

from pathlib import Path

import torch

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: Path,
    out: Path,
    r: int,
    targets: list[str],
    alpha: float = 16.0,
    rslora: bool = False,
    seed: int = 0,
    std: float = 0.2,
) -> Path:
    """A PEFT LoRA adapter on ``base_dir`` with random nonzero A and B (PEFT starts B at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = get_peft_model(
        base,
        LoraConfig(
            r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0, bias="none"
        ),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(str(out))
    return out


def hf_peft_greedy(base_dir: Path, adapter_dir, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy continuations of HF transformers with the adapter merged into the float32 weights (None: base)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            g = model.generate(
                torch.tensor([p]),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(g[0, len(p) :].tolist())
    return outs
