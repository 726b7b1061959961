"""Build the offline demo model: a small random-weight Qwen2-style checkpoint.

The tokenizer is a byte-level BPE trained here on a built-in corpus, so any
text (Chinese, emoji) round-trips; the chat template is ChatML. The result is a
regular Hugging Face directory (config.json, model.safetensors, tokenizer.json,
generation_config.json) that transformers and our loader both read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

DEMO_VERSION = 1

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

DEMO_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "hidden_act": "silu",
    "initializer_range": 0.05,
}

_CORPUS = """
The KV cache stores the keys and values of every token a model has already seen, so each new token
only computes attention against cached state instead of recomputing the whole prompt. Paged attention
splits the cache into fixed-size blocks, like pages of virtual memory, so requests of any length share
one pool without fragmentation. Prefix caching lets many requests that start with the same system prompt
reuse the same blocks. Continuous batching adds and removes requests at every step, keeping the GPU busy.
Quantization stores weights in eight or four bits, which makes memory-bound decoding faster.
Speculative decoding drafts several tokens with a small model and verifies them with the large one.
A semantic cache answers a question that is close enough to one answered before without running the model.
Spring services call the sidecar through a ChatClient; the sidecar streams tokens back over gRPC.
Customer service: How do I reset my password? Where is my order? Can I change the delivery address?
What are your opening hours? Is port 6379 open by default? How much memory does the cache use?
def generate(prompt, max_tokens=64): return engine.step() # Python code
public class ChatController { @PostMapping("/api/chat/message") String chat() { return reply; } }
SELECT id, name FROM users WHERE created_at > now() - interval '1 day';
0123456789 + - * / = < > ( ) [ ] { } , . ; : ! ? ' " # @ % & _ ~ ^ | \\
Hello world! Good morning. Thank you very much. You are welcome. See you tomorrow.
你好，世界。今天天气很好。我们一起学习机器学习和大语言模型。缓存可以让推理更快。
こんにちは。ありがとうございます。 Bonjour le monde. Hallo Welt. Hola mundo. Привет, мир.
😀 🚀 ✅ ❤️ 👍 🎉 🤖 📦
"""


def sidecar_home() -> Path:
    """Where built artifacts (demo and benchmark models) live: $SIDECAR_HOME or the user cache dir.
    (Not SIDECAR_CACHE_*: that prefix belongs to the semantic-cache settings.)"""
    base = os.environ.get("SIDECAR_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "llm-sidecar"
    )
    return Path(base)


def default_demo_dir() -> Path:
    return sidecar_home() / f"demo-model-v{DEMO_VERSION}"


def _build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    tok.train_from_iterator(lines * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_demo_model(
    out_dir: str | Path, seed: int = 0, config_overrides: Optional[dict] = None, vocab_size: int = 1024
) -> Path:
    """Write the demo checkpoint to ``out_dir`` atomically (built in a temp dir, then renamed)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=out_dir.parent))
    try:
        tokenizer = _build_tokenizer(vocab_size)
        cfg = dict(DEMO_CONFIG, **(config_overrides or {}))
        cfg.pop("architectures")
        cfg.pop("model_type")
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        config = Qwen2Config(
            vocab_size=len(tokenizer), eos_token_id=eos, pad_token_id=pad, bos_token_id=None, **cfg
        )
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        GenerationConfig(
            eos_token_id=[eos, pad], pad_token_id=pad, bos_token_id=None, do_sample=False
        ).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "sidecar_demo.json").write_text(json.dumps({"version": DEMO_VERSION, "seed": seed}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _is_current(path: Path) -> bool:
    try:
        return json.loads((path / "sidecar_demo.json").read_text()).get("version") == DEMO_VERSION
    except (OSError, ValueError):
        return False


def ensure_demo_model(demo_dir: Optional[str] = None) -> Path:
    """Return the demo model directory, building it once if missing or stale.

    Safe when several processes start at once: the build runs under an exclusive file lock and the
    others wait, then reuse it (a reader never sees a half-written or replaced directory)."""
    import fcntl

    path = Path(demo_dir) if demo_dir else default_demo_dir()
    if _is_current(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_current(path):
            build_demo_model(path)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", nargs="?", default=None, help="output directory (default: the user cache dir)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if the directory holds a demo model"
    )


def run(args: argparse.Namespace) -> int:
    target = Path(args.dir) if args.dir else default_demo_dir()
    if args.force or not (target / "sidecar_demo.json").exists():
        build_demo_model(target, seed=args.seed)
        print(f"demo model written to {target}")
    else:
        print(f"demo model already at {target} (use --force to rebuild)")
    return 0
