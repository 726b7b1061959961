"""Parameter counts of a model from its arguments alone: the total and the active per token (a sparse layer's
idle experts left out), reported by ``/v1/models`` and ``GetModelInfo``."""

from __future__ import annotations

from sidecar.model.args import ModelArgs
from sidecar.model.latent_args import latent_attention_parameters


def parameter_counts(args: ModelArgs) -> tuple[int, int]:
    """(total, active per token) parameters of the model ``args`` describe: a sparse layer counts its router
    and all of its experts in the total, its router and ``experts_per_token`` experts in the active count."""
    h = args.hidden_size
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    attn = h * (q + 2 * kv) + q * h + 2 * h
    if args.attention_bias:
        attn += q + 2 * kv
    if args.o_proj_bias:
        attn += h
    if args.qk_norm:
        attn += 2 * args.head_dim
    if args.sandwich_norms:
        attn += 2 * h
    if args.attn_sinks:
        attn += args.num_heads
    if args.attn_output_gate:  # q_proj holds a gate row beside each query row
        attn += h * q + (q if args.attention_bias else 0)
    if args.latent is not None:
        attn = latent_attention_parameters(args.latent, h, args.num_heads, args.attention_bias)
    dense = 3 * h * args.intermediate_size + (2 * args.intermediate_size + h if args.mlp_bias else 0)
    expert = 3 * h * args.expert_intermediate_size
    if args.expert_bias:
        expert += 2 * args.expert_intermediate_size + h
    router = args.num_experts * (h + (1 if args.router_bias else 0)) + 3 * h * args.shared_expert_size
    if args.shared_expert_size and args.shared_expert_gate:
        router += h
    if args.routing is not None:  # the shared experts run for every token (grouped_moe.py)
        router += 3 * h * args.routing.shared_intermediate_size
    total = active = args.vocab_size * h * (1 if args.tie_word_embeddings else 2) + h
    for i in range(args.num_layers):
        mixer = attn if not args.is_linear(i) else _deltanet_parameters(args)
        if args.sparse(i):
            total += mixer + router + args.num_experts * expert
            active += mixer + router + args.experts_per_token * expert
        else:
            total += mixer + dense
            active += mixer + dense
    return total, active


def _deltanet_parameters(args: ModelArgs) -> int:
    """A gated DeltaNet layer's mixer and its two norms: the q/k/v and z, b, a projections, the convolution's
    taps, dt_bias and A_log per value head, the gated norm and the output projection."""
    s, h = args.linear, args.hidden_size
    v = s.num_v_heads * s.v_dim
    projections = h * (s.conv_dim + v + 2 * s.num_v_heads) + v * h
    return projections + s.conv_dim * s.conv_kernel + 2 * s.num_v_heads + s.v_dim + 2 * h
