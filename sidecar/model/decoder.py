"""The causal decoder every family assembles: embeddings, ``DecoderLayer`` s built from ``ModelArgs``, the final
norm and the head, over packed variable-length tokens.

The model sees one flat batch of ``T`` new tokens (all requests of a step concatenated) with their positions;
attention metadata tells each token which KV blocks form its context. Projections are fused (qkv, gate+up) at
load time.

Device fast paths: the model owns one ``FastPaths`` (``fast_paths``) and every layer holds that same instance.
Fields are flipped in place on the shared instance, never by assigning a new one.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sidecar.model import grouped_moe, mla, rope
from sidecar.model.args import ModelArgs
from sidecar.model.attention import AttentionMetadata, sdpa_backends
from sidecar.model.kernels.gpu_paths import FastPaths
from sidecar.model.layers import DecoderLayer, RMSNorm
from sidecar.model.linear import Linear
from sidecar.model.moe import SparseMoE


class CausalLM(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.fast_paths = FastPaths()  # all off: the runner's self-check turns paths on
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        moe = grouped_moe.GroupedMoE if args.routing is not None else SparseMoE
        self.layers = nn.ModuleList(
            DecoderLayer(
                args,
                i,
                self.fast_paths,
                moe(args, self.fast_paths) if args.sparse(i) else None,
                mla.LatentAttention(args, self.fast_paths) if args.latent is not None else None,
            )
            for i in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, self.fast_paths)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        # [kinds, rows, rotary_dim] (rope.tables); rows past max_positions hold LongRoPE's long half
        self.rope_cos: Optional[torch.Tensor] = None
        self.rope_sin: Optional[torch.Tensor] = None
        self.rope_rows_per_half = 0

    def share_fast_paths(self) -> None:
        """Hands ``fast_paths`` to the modules swapped in after construction (quantized linears, which
        take it through ``set_fast_paths``). The loader calls it once the weights are in place."""
        for module in self.modules():
            if hasattr(module, "set_fast_paths"):
                module.set_fast_paths(self.fast_paths)

    def init_rope(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        """Precompute cos/sin of every rope kind for positions [0, max_positions) (float32 math, stored in the
        model dtype; float32 for an interleaved rope)."""
        a = self.args
        # HF's complex rope (interleaved pairs: Llama 4) keeps its table and its product in float32 whatever
        # the model dtype (attention_local.rotate_interleaved), so its table stays float32 here too.
        table_dtype = torch.float32 if a.interleaved_rope else dtype
        self.rope_cos, self.rope_sin = rope.tables(
            a.rope_kinds, a.rotary, max_positions, a.max_position_embeddings, device, table_dtype
        )
        self.rope_rows_per_half = max_positions

    @property
    def rope_long_from(self) -> Optional[int]:
        """LongRoPE's original length (a longer sequence is computed on the long factors), else None."""
        return rope.long_from(self.args.rope_kinds)

    def rope_offset(self, num_tokens: int) -> int:
        """What to add to the positions of a sequence's tokens to find their rope rows: LongRoPE's long half
        for every token of a sequence of more than the original length (rope.py), else 0."""
        orig = self.rope_long_from
        return self.rope_rows_per_half if orig is not None and num_tokens > orig else 0

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``input_ids`` [T], times ``embed_scale`` where the family scales them (HF: the scale as
        a float32 scalar cast to the model dtype, then the product in that dtype)."""
        rows = self.embed_tokens(input_ids)
        scale = self.args.embed_scale
        if scale is None:
            return rows
        return rows * torch.tensor(scale, dtype=torch.float32).to(rows.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, ...]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] (positions plus ``rope_offset``). Returns final hidden states [T, hidden]."""
        cos, sin = self.rope_rows(positions)
        meta.positions = positions
        return self.forward_embedded(self.embed(input_ids), cos, sin, kv_caches, meta)

    def rope_rows(
        self,
        positions: torch.Tensor,
        out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [kinds, T, 1, rotary_dim] of ``positions`` [T]; written into ``out`` ([kinds, >= T, 1,
        rotary_dim] each) when given."""
        if out is None:
            return (
                self.rope_cos.index_select(1, positions)[:, :, None, :],
                self.rope_sin.index_select(1, positions)[:, :, None, :],
            )
        t = positions.shape[0]
        rows = []
        for table, buf in zip((self.rope_cos, self.rope_sin), out):
            for kind in range(table.shape[0]):
                torch.index_select(table[kind], 0, positions, out=buf[kind, :t, 0])
            rows.append(buf[:, :t])
        return rows[0], rows[1]

    def forward_embedded(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, ...]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The decoder over embedded tokens ``h`` [T, hidden] with their rope rows (``rope_rows``): final hidden
        states [T, hidden]. On a CPU with our kernels every operation of a plain Llama-shaped layer runs in one of
        them (what lets a decode step be replayed from C: ``engine/cpu_graphs.py``, which refuses a step that
        runs anything else)."""
        delta = None
        with sdpa_backends(h.device):
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
                h, delta = layer(h, delta, cos, sin, kv, meta.for_layer(i))
        return self.norm(h, delta)[0]

    def logits_at(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``compute_logits`` of the rows ``rows`` (a long tensor) of ``hidden``: what a step samples from."""
        return self.compute_logits(hidden.index_select(0, rows))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of ``hidden`` [N, hidden]; soft-capped (``cap * tanh(logits / cap)``) where the family
        caps them."""
        # our Linear's widened product (tile layout); quantized heads lack it
        widened = getattr(self.lm_head, "float_forward", None)
        logits = widened(hidden) if widened is not None else None
        logits = logits if logits is not None else self.lm_head(hidden).float()
        cap = self.args.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
