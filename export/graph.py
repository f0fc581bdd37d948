"""The decoder graph: ``models.decoder.TreeDecoder`` (with a graph-friendly attention,
:class:`ExportTreeDecoder`) traced to ONNX with the in-graph reductions the host reads every
step.

Graph contract (``../shared/DESIGN.md``)::

    inputs   input_ids [1, T] int64        ids >= vocab select row id - vocab of mask_embeds
             position_ids [1, T] int64
             tree_mask [1, 1, T, T] bool   the block only; the graph adds the cache columns
             mask_embeds [k, d] float32
             past_key_i, past_value_i [1, P, H_kv, D]     per layer, sequence-major (the
                                            values float64 in an int4/int8 package, whose
                                            exact attention sums read them so)
             past_len [1] int64             the first past_len of the P rows are the cache;
                                            the rest are masked (a backend may bind a fixed
                                            or bucketed view of its cache: fewer rebinds, and
                                            fixed shapes for CUDA graphs)
    outputs  topk_ids [1, T, K] int64, topk_logprobs [1, T, K] float32
             argmax [1, T] int64           first maximal index, as torch.argmax / np.argmax
             logits [1, T, V] float32      bind it only when sampling needs it
             present_key_i, present_value_i [1, T, H_kv, D]   the block's new rows only
             hidden_states [1, T, d] float32   after the final norm (what the LM head reads);
                                            only with --hidden-states, for learned heads

``T``, ``P`` and ``k`` are dynamic; ``K`` is fixed at export (the widest plan's N + 1).
ONNX Runtime runs every node whatever outputs are asked for, but ``logits`` is the lm_head
result that TopK and ArgMax need anyway, so an unbound ``logits`` costs no extra compute and
no device-to-host copy.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from edgemtp.errors import UnsupportedModelError
from edgemtp.models.decoder import TreeDecoder
from edgemtp.runtimes.package import FIXED_INPUTS, HIDDEN, graph_inputs, graph_outputs

# rotary types whose frequencies change with the sequence length at run time: a traced graph
# would freeze one branch of that data-dependent update
DYNAMIC_ROPE = ("dynamic", "longrope")
MASKED = -65504.0  # the additive bias of a masked key: fp16's lowest finite value


class ExportTreeDecoder(TreeDecoder):
    """TreeDecoder with an attention written for the graph, not for PyTorch: the same math
    (the self-check holds it to the reference TreeDecoder), about half the run time in
    ONNX Runtime for a small model.

    - grouped-query attention by folding each KV head's query group into the row axis
      (``[1, H, T, D] -> [1, H_kv, g*T, D]``), instead of ``repeat_interleave``, which copies
      the whole cache ``g`` times per layer per step;
    - reshapes with ``-1`` instead of traced sizes (no Shape/Gather/Concat chains), and the
      past's row count read once for every layer (SmolLM2 fp32: 3514 -> 3427 nodes, 30 -> 1
      Shape; the same bits; t(1) 0.88x, 0.88x and 1.06x in three sittings on the 2-core VM,
      which is within what it moves between them);
    - the past K/V read where they lie: attention over the past and over the block as two
      MatMuls each (no concatenation of the cache, an O(P) copy per layer per step, and no
      transposed copy of it: onnxruntime fuses the permutes into FusedMatMul);
    - an additive mask applied in float32, instead of SDPA's decomposition (IsNaN guards).

    ``exact_attention`` (int4/int8 exports): the softmax and ``probs @ values`` as exact sums
    (:func:`exact_sums`), so a row's attention does not depend on the block it sits in.
    ONNX Runtime's float32 softmax sums its row in SIMD lanes chosen by column index, its GEMM
    sums ``probs @ values`` in blocks of 256 columns, and a row's ancestors sit at other
    columns in a block than in the cache: the same numbers are added in different orders, and
    int8 activations (MatMulNBits accuracy level 4) turn that last bit into logit differences
    of ~1 (``bench/results/quant_cpu.md``).
    """

    exact_attention: bool = False  # True: exact_sums (int4/int8 exports)
    # a head-major past ([1, H_kv, P, D], ``--cache-layout head``; not with exact sums): each
    # KV head's rows are one contiguous block, and a one-row step is one matrix-vector
    # product per query head, which onnxruntime's MLAS streams without packing the past
    # (P = 2048: 8.5 -> 4.8 ms of attention a step for SmolLM2, bench/results/
    # attention_layout_cpu.md)
    head_major: bool = False

    @property
    def cache_axis(self) -> int:
        return 2 if self.head_major else 1
    # onnxruntime's fused contrib ops (RotaryEmbedding, SkipSimplifiedLayerNormalization) in
    # place of their decompositions: int4/int8 exports, whose MatMulNBits already tie the
    # graph to onnxruntime (see :meth:`fuse`)
    fused: bool = False

    def fuse(self, positions: int) -> bool:
        """Use onnxruntime's contrib ops for the rotary embedding and the residual add +
        RMSNorm: ~12 fewer nodes per layer, each a row-wise or elementwise kernel, so a row's
        result stays independent of its block. The rotary tables are precomputed for
        ``positions`` by the model's own rotary module (bitwise its cos/sin). False, and
        nothing changes, where the rotary embedding is not the full-width rotate-half kind."""
        pos = torch.arange(positions)[None]
        probe = torch.zeros(1, 1, self.head_dim)
        with torch.no_grad():
            cos, sin = self.model.rotary_emb(probe, pos)
        half = self.head_dim // 2
        if cos.shape[-1] != self.head_dim or not (torch.equal(cos[..., :half], cos[..., half:])
                                                  and torch.equal(sin[..., :half], sin[..., half:])):
            return False
        cos, sin = cos[0, :, :half].float().contiguous(), sin[0, :, :half].float().contiguous()
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        # a power-of-two softmax scale (head_dim 64: 1/8) rides on q's tables: scaling by a
        # power of two is exact, so q_rot * scale comes out bitwise the same, one Mul fewer
        scale = float(self.model.layers[0].self_attn.scaling)
        self.q_scaled = math.frexp(scale)[0] == 0.5
        self.register_buffer("q_cos_cache", cos * scale if self.q_scaled else cos, persistent=False)
        self.register_buffer("q_sin_cache", sin * scale if self.q_scaled else sin, persistent=False)
        self.fused = True
        return True

    # no traced sizes of the block (T) or of the mask slots (k): onnxruntime places a node that
    # computes a shape from an input's size on the CPU, and a CUDA graph needs every node on the
    # GPU (onnxruntime refused the capture on an H200 for 18 such nodes). With the past's rows
    # fixed at load (``add_free_dimension_override_by_name("P", rows)``, the fixed-buffer
    # session's whole cache), the graph then holds no Shape node at all (tested).

    def embed(self, input_ids, mask_embeds):
        # a mask slot is id - vocab (0 for a token; the engine feeds slots < k only): no clamp
        # to k - 1, which would read k from mask_embeds' shape
        is_mask = input_ids >= self.vocab_size
        tok = self.model.embed_tokens(input_ids.clamp(max=self.vocab_size - 1))
        slot = (input_ids - self.vocab_size).clamp(min=0)
        return torch.where(is_mask.unsqueeze(-1), mask_embeds.to(tok.dtype)[slot], tok)

    @staticmethod
    def block_mask(tree_mask, rows: int, past_len=None):
        if past_len is None:
            return TreeDecoder.block_mask(tree_mask, rows, past_len)
        col = tree_mask[..., :1]
        every_row = col | ~col  # [1, 1, T, 1] all true, T taken from the data's broadcast
        cache_cols = (torch.arange(rows, device=tree_mask.device) < past_len)[None, None, None]
        return torch.cat([cache_cols & every_row, tree_mask], dim=-1)

    # the past's row count, read once from the first layer's past for every layer (traced:
    # one Shape node for the graph, not one per layer, where the past's rows are not fixed
    # at load); set by body(), which every attention call runs under
    _past_rows = None

    def body(self, input_ids, position_ids, tree_mask, mask_embeds, past_keys, past_values,
             past_len=None):
        self._past_rows = past_keys[0].shape[self.cache_axis]
        try:
            return self._body(input_ids, position_ids, tree_mask, mask_embeds, past_keys,
                              past_values, past_len)
        finally:
            self._past_rows = None

    def _body(self, input_ids, position_ids, tree_mask, mask_embeds, past_keys, past_values,
              past_len=None):
        if not self.fused:
            return super().body(input_ids, position_ids, tree_mask, mask_embeds, past_keys,
                                past_values, past_len)
        x = self.embed(input_ids, mask_embeds)
        mask = self.block_mask(tree_mask, self._past_rows, past_len)
        layers = self.model.layers
        h = layers[0].input_layernorm(x)
        # the tables end at the context's last position; a block near the end may hold draft
        # rows past it (never committed, never read for an emitted token), which
        # RotaryEmbedding would refuse: they read the last row instead
        pos = position_ids.clamp(max=self.cos_cache.shape[0] - 1)
        new_keys, new_values = [], []
        for i, (layer, pk, pv) in enumerate(zip(layers, past_keys, past_values)):
            a, k, v = self._fused_attention(layer, h, pos, mask, pk, pv)
            new_keys.append(k)
            new_values.append(v)
            norm = layer.post_attention_layernorm
            h, x = SkipNorm.apply(a, x, norm.weight, _eps(norm))
            m = self._gated_mlp(layer.mlp, h)
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h, x = SkipNorm.apply(m, x, norm.weight, _eps(norm))
        return h, new_keys, new_values

    def _fused_attention(self, layer, h, position_ids, mask, past_k, past_v):
        # h: [1, T, d] (normed); mask: [1, 1, T, P + T] bool; past_k/v: [1, P, H_kv, D]
        attn, hd = layer.self_attn, self.head_dim
        q, k, v = fused_linear(h, attn.q_proj, attn.k_proj, attn.v_proj)
        if self.family.qk_norm:
            q = attn.q_norm(q.view(1, -1, self.n_heads, hd)).flatten(2)
            k = attn.k_norm(k.view(1, -1, self.n_kv, hd)).flatten(2)
        q = Rotary.apply(q, position_ids, self.q_cos_cache, self.q_sin_cache, self.n_heads)
        k = Rotary.apply(k, position_ids, self.cos_cache, self.sin_cache, self.n_kv)
        k = k.view(1, -1, self.n_kv, hd)                          # [1, T, H_kv, D]: present
        q = q.view(1, -1, self.n_heads, hd).transpose(1, 2).reshape(self.n_kv, -1, hd)
        out, v = self._attend(attn, q, k[0].permute(1, 2, 0), v.view(1, -1, self.n_kv, hd),
                              mask, past_k, past_v, None if self.q_scaled else attn.scaling)
        return out, k, v

    def _attention(self, layer, x, cos, sin, mask, past_k, past_v):
        # x: [1, T, d]; mask: [1, 1, T, P + T] bool; past_k/v: [1, P, H_kv, D]
        attn, hd = layer.self_attn, self.head_dim
        h = layer.input_layernorm(x)
        # one MatMul for q, k and v (one quantized kernel call instead of three)
        q, k, v = fused_linear(h, attn.q_proj, attn.k_proj, attn.v_proj)
        q = q.view(1, -1, self.n_heads, hd)
        k = k.view(1, -1, self.n_kv, hd)
        v = v.view(1, -1, self.n_kv, hd)
        if self.family.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        # the rotary embedding of q and k at once, its halves sliced at constant offsets
        qk = rotate(torch.cat([q, k], dim=2).transpose(1, 2), cos, sin, hd // 2)
        q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]                 # [1, H(_kv), T, D]
        # query head h = kv * g + j reads KV head kv (as repeat_interleave): rows j * T + t
        q = q.reshape(self.n_kv, -1, hd)                                  # [H_kv, g*T, D]
        out, v = self._attend(attn, q, k[0].transpose(1, 2), v, mask, past_k, past_v,
                              attn.scaling)
        return out, k.transpose(1, 2), v

    def _attend(self, attn, q, k_t, v, mask, past_k, past_v, scale):
        """Attention of ``q [H_kv, g*T, D]`` (rotated) over the past and the block's own
        keys ``k_t [H_kv, D, T]``, then o_proj; ``v [1, T, H_kv, D]``. ``scale``: the softmax
        scale, or None where q already carries it. Returns the output and the block's V as
        the cache keeps it (on the exact sums' grid, float64, in an int4/int8 export)."""
        hd, g = self.head_dim, self.n_heads // self.n_kv
        past = self._past_rows
        scores = torch.cat([self._past_scores(q, past_k),                  # [H_kv, g*T, P]
                            torch.matmul(q, k_t)], dim=-1).float()
        # a finite mask value: -inf makes a fully masked row NaN, and -65504 (fp16's lowest)
        # stays finite in fp16 too; exp() of it underflows to exactly 0 in the softmax
        bias = torch.where(mask, 0.0, MASKED).repeat(1, 1, g, 1)[0]       # [1, g*T, P+T]
        logits = (scores if scale is None else scores * scale) + bias
        if self.exact_attention:  # (sequence-major only: ExportOptions refuses the other)
            # what the cache keeps (see exact_sums), in float64: p @ V is summed in float64,
            # and a float64 cache spares a cast of the whole past every layer and step
            v = (torch.round(v * V_GRID) / V_GRID).double()
            out = exact_sums(logits, past_v.squeeze(0).permute(1, 0, 2),
                             v[0].transpose(0, 1), past).to(q.dtype)
        else:
            probs = torch.softmax(logits, dim=-1).to(past_v.dtype)
            out = (self._past_values(probs[..., :past], past_v)
                   + torch.matmul(probs[..., past:], v[0].transpose(0, 1))).to(v.dtype)
        out = attn.o_proj(out.reshape(1, self.n_heads, -1, hd).transpose(1, 2)
                          .reshape(1, -1, self.n_heads * hd))
        return out, v

    # The past is never copied. Sequence-major ([1, P, H_kv, D]): read in place by MatMuls
    # onnxruntime fuses with the permutes (FusedMatMul, transBatchB). Head-major ([1, H_kv,
    # P, D]): the queries as [1, H_kv, g, T, D] against the past broadcast over the group
    # ([1, H_kv, 1, P, D]), so each query head of a one-row step is an M = 1 product over its
    # KV head's contiguous rows, which MLAS streams unpacked.

    def _past_scores(self, q, past_k):
        # q [H_kv, g*T, D] -> [H_kv, g*T, P]
        if not self.head_major:
            return torch.matmul(q, past_k.squeeze(0).permute(1, 2, 0))
        g, hd = self.n_heads // self.n_kv, self.head_dim
        s = torch.matmul(q.reshape(1, self.n_kv, g, -1, hd), past_k.unsqueeze(2).transpose(-1, -2))
        return s.reshape(self.n_kv, -1, self._past_rows)

    def _past_values(self, p, past_v):
        # p [H_kv, g*T, P] -> [H_kv, g*T, D]
        if not self.head_major:
            return torch.matmul(p, past_v.squeeze(0).permute(1, 0, 2))
        g, hd = self.n_heads // self.n_kv, self.head_dim
        out = torch.matmul(p.reshape(1, self.n_kv, g, -1, p.shape[-1]), past_v.unsqueeze(2))
        return out.reshape(self.n_kv, -1, hd)

    def _mlp(self, layer, x):
        return self._gated_mlp(layer.mlp, layer.post_attention_layernorm(x))

    @staticmethod
    def _gated_mlp(mlp, h):
        gate, up = fused_linear(h, mlp.gate_proj, mlp.up_proj)
        return mlp.down_proj(mlp.act_fn(gate) * up)


def _eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def rms_norm(x, weight, eps: float):
    """transformers' LlamaRMSNorm (Qwen2/3 and Mistral share it)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class SkipNorm(torch.autograd.Function):
    """``(rms_norm(x + skip), x + skip)``: one onnxruntime SkipSimplifiedLayerNormalization
    node in the graph (row-wise, like the Add and the norm it replaces)."""

    @staticmethod
    def forward(ctx, x, skip, weight, eps):
        s = x + skip
        return rms_norm(s, weight, eps), s

    @staticmethod
    def symbolic(g, x, skip, weight, eps):
        out = g.op("com.microsoft::SkipSimplifiedLayerNormalization", x, skip, weight,
                   epsilon_f=eps, outputs=4)
        out[0].setType(x.type())
        out[3].setType(x.type())
        return out[0], out[3]


class Rotary(torch.autograd.Function):
    """The rotate-half rotary embedding of ``x [1, T, heads * D]`` at ``position_ids`` from
    precomputed ``cos/sin [positions, D / 2]`` tables: one onnxruntime RotaryEmbedding node
    (elementwise) in the graph."""

    @staticmethod
    def forward(ctx, x, position_ids, cos_cache, sin_cache, heads):
        b, t, width = x.shape
        d = width // heads
        xh = x.view(b, t, heads, d)
        cos = cos_cache[position_ids].unsqueeze(2).repeat(1, 1, 1, 2)   # [1, T, 1, D]
        sin = sin_cache[position_ids].unsqueeze(2).repeat(1, 1, 1, 2)
        rot = torch.cat([-xh[..., d // 2:], xh[..., :d // 2]], dim=-1)
        return (xh * cos + rot * sin).reshape(b, t, width)

    @staticmethod
    def symbolic(g, x, position_ids, cos_cache, sin_cache, heads):
        out = g.op("com.microsoft::RotaryEmbedding", x, position_ids, cos_cache, sin_cache,
                   interleaved_i=0, num_heads_i=heads)
        out.setType(x.type())
        return out


def fused_linear(x, *linears: nn.Linear):
    """``linear(x)`` for each of ``linears`` as one MatMul over their concatenated weights (the
    export folds the concatenation into one initializer; a quantized package quantizes each
    output column on its own, so the weights are those of the separate projections)."""
    weight = torch.cat([m.weight for m in linears], dim=0)
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.bias if m.bias is not None
                          else m.weight.new_zeros(m.out_features) for m in linears])
    return F.linear(x, weight, bias).split([m.out_features for m in linears], dim=-1)


def rotate(x, cos, sin, half: int):
    """``apply_rotary_pos_emb``'s arithmetic on ``x [1, H, T, D]`` with ``cos``/``sin``
    ``[1, T, D]``, the halves sliced at the constant ``half = D / 2`` (transformers'
    ``rotate_half`` reads ``x.shape[-1]``, which traces to a Shape/Gather/Div chain per call)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


# exact_sums' grids (powers of two: every scaling below is exact)
E_GRID = 2.0 ** 39   # exp(l - max) in [0, 1] -> integers <= 2^39; a row of < 2^13 sums exactly
P_GRID = 2.0 ** 24   # probabilities -> integers <= 2^24
V_GRID = 2.0 ** 18   # values -> multiples of 2^-18 (exact sums while |v| < 2^10)


def exact_sums(logits, v_past, v_new, past: int):
    """Softmax and ``probs @ values`` whose every sum is exact, hence the same in any order.

    Rounding each summand to a fixed grid before summing makes float64 addition exact while
    the partial sums stay below 2^53 units: ``exp(l - max)`` on a 2^-39 grid (a row of
    ``P + T < 2^13`` columns sums to < 2^52), probabilities on a 2^-24 grid (integers
    ``<= 2^24``), and values on a 2^-18 grid, which the graph applies to the block's V before
    it becomes the cache (a float32 stays a multiple of 2^-18 above 2^6 too). While
    ``|v| < 2^10`` every product ``p * v`` is a multiple of 2^-18 and every partial sum stays
    under 2^52 units. The max, the exponentials and the one multiplication per element are
    elementwise, so a row gives the same bits alone, inside any block, and with its ancestors
    in the cache or in the block. The grids cost < 3e-8 in a probability and 2e-6 in a value
    (SmolLM2-135M's values stay under 16), far inside an int8-activation package's own error;
    a value beyond 2^10 loses the guarantee, not correctness.

    ``exp(l - max)`` is taken in float32 (MLAS: vectorized, and the same bits for an element
    wherever it sits in the tensor, tail included -- checked over lengths 1-199 and offsets);
    scaled by 2^39 (exact) and rounded it is an integer, exact in float64 from there. Float32
    exponentials cost a relative 6e-8 in a weight; float64's (Eigen) were ~4x dearer per
    element and could round a tensor's last elements another way.
    """
    m = logits.amax(dim=-1, keepdim=True)
    e = torch.round(torch.exp(logits - m) * E_GRID).double()  # integers <= 2^39
    # one small division per row, then a multiplication per element (cheaper than a
    # division per element; elementwise, so as block-independent)
    p = torch.round(e * (P_GRID / e.sum(dim=-1, keepdim=True)))
    out = (torch.matmul(p[..., :past], v_past.double())
           + torch.matmul(p[..., past:], v_new.double()))
    return out / P_GRID


class ExportDecoder(nn.Module):
    """TreeDecoder with flat per-layer K/V arguments and the top-K / argmax reductions;
    ``hidden``: the last hidden states as one more output, last."""

    def __init__(self, decoder: TreeDecoder, topk: int, hidden: bool = False) -> None:
        super().__init__()
        self.decoder, self.topk, self.hidden = decoder, topk, hidden

    def forward(self, input_ids, position_ids, tree_mask, mask_embeds, *past):
        # past: past_key_0, past_value_0, past_key_1, ... each [1, P, H_kv, D], then past_len
        past, past_len = past[:-1], past[-1]
        h, keys, values = self.decoder.body(input_ids, position_ids, tree_mask, mask_embeds,
                                            list(past[0::2]), list(past[1::2]), past_len)
        logits = self.decoder.lm_head(h).float()                    # [1, T, V]
        top, ids = logits.topk(self.topk, dim=-1)
        # log-softmax of the top-K only: no second [T, V] tensor. logsumexp spelled out:
        # onnxruntime's ReduceLogSumExp is ~7x slower than max, exp, sum, log (0.39 vs
        # 0.06 ms for 2 rows of a 49152-token vocabulary)
        top_logit = top[..., :1]  # the row's max
        lse = top_logit + torch.log(torch.exp(logits - top_logit).sum(dim=-1, keepdim=True))
        logprobs = top - lse
        argmax = logits.argmax(dim=-1)
        present = [t for kv in zip(keys, values) for t in kv]
        return (ids, logprobs, argmax, logits, *present, *([h.float()] if self.hidden else []))


def check_rope(config) -> None:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    rope = rope if isinstance(rope, dict) else {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in DYNAMIC_ROPE:
        raise UnsupportedModelError(
            f"rope type {kind!r} rescales the rotary frequencies with the sequence length at "
            f"run time, which one static graph cannot hold; supported: default, linear, llama3, "
            f"yarn and other fixed scalings")


def example_inputs(decoder: TreeDecoder, dtype: torch.dtype, t: int = 5, p: int = 3,
                   k: int = 2) -> tuple[torch.Tensor, ...]:
    """Trace inputs; T, P and k differ so the tracer cannot confuse their dimensions."""
    hidden = decoder.model.embed_tokens.weight.shape[1]
    ids = torch.arange(t, dtype=torch.long)[None] % decoder.vocab_size
    ids[0, -1] = decoder.vocab_size                                  # one mask slot
    pos = torch.arange(p, p + t, dtype=torch.long)[None]
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))[None, None]
    embeds = torch.zeros(k, hidden, dtype=torch.float32)
    layers = len(decoder.model.layers)
    v_dtype = torch.float64 if getattr(decoder, "exact_attention", False) else dtype
    shape = ((1, decoder.n_kv, p, decoder.head_dim) if getattr(decoder, "head_major", False)
             else (1, p, decoder.n_kv, decoder.head_dim))
    past = [torch.zeros(*shape, dtype=dt) for _ in range(layers) for dt in (dtype, v_dtype)]
    return (ids, pos, mask, embeds, *past, torch.tensor([p - 1]))


def dynamic_axes(layers: int, hidden: bool = False,
                 cache_axis: int = 1) -> dict[str, dict[int, str]]:
    axes = {"input_ids": {1: "T"}, "position_ids": {1: "T"}, "tree_mask": {2: "T", 3: "T"},
            "mask_embeds": {0: "k"}}
    for name in graph_inputs(layers)[len(FIXED_INPUTS):-1]:  # past K/V; past_len is [1]
        axes[name] = {cache_axis: "P"}
    for name in graph_outputs(layers, hidden):
        axes[name] = {1: "T"}
    return axes


def trace_to_onnx(module: ExportDecoder, path: Path, dtype: torch.dtype, opset: int) -> None:
    """Trace ``module`` into ``path`` (large models may spill weights into files beside it)."""
    dec = module.decoder
    layers = len(dec.model.layers)
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")  # TracerWarnings about shape arithmetic are expected
        torch.onnx.export(module, example_inputs(dec, dtype), str(path),
                          input_names=graph_inputs(layers),
                          output_names=graph_outputs(layers, module.hidden),
                          dynamic_axes=dynamic_axes(layers, module.hidden,
                                                    getattr(dec, "cache_axis", 1)),
                          opset_version=opset,
                          do_constant_folding=True, dynamo=False)


def tidy_graph(model, module: ExportDecoder) -> None:
    """Write the contract's output shapes into the graph (the tracer leaves generated names
    such as ``TopKtopk_ids_dim_0`` or ``Reshapepresent_value_4_dim_2`` where a size is
    known), and give every weight its own initializer (:func:`own_initializers`)."""
    own_initializers(model)
    dec = module.decoder
    kv = [1, "T", dec.n_kv, dec.head_dim]
    shapes = {"topk_ids": [1, "T", module.topk], "topk_logprobs": [1, "T", module.topk],
              "argmax": [1, "T"], "logits": [1, "T", dec.vocab_size],
              HIDDEN: [1, "T", dec.model.embed_tokens.weight.shape[1]]}
    for out in model.graph.output:
        dims = out.type.tensor_type.shape.dim
        want = shapes.get(out.name, kv)
        assert len(dims) == len(want), (out.name, len(dims), want)
        for dim, value in zip(dims, want):
            if isinstance(value, str):
                dim.dim_param = value
            else:
                dim.ClearField("dim_param")
                dim.dim_value = value


def own_initializers(model) -> None:
    """The tracer stores bit-identical weights once and reads the copies through ``Identity``
    nodes named as the weights (a model whose layers repeat: a depth up-scaled model, a
    passthrough merge; a fresh model's norms of 1). Each becomes an initializer of its own
    under that name: the int4/int8 quantizer converts only products whose weight is an
    initializer (the copies stayed float32, and a model whose layer 1 copies layer 0 failed
    its self-check by a logit of 1.24), and the native decoder finds every layer's norm by
    name."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    for node in list(graph.node):
        if node.op_type == "Identity" and node.input[0] in inits:
            copy = graph.initializer.add()
            copy.CopyFrom(inits[node.input[0]])
            copy.name = node.output[0]
            graph.node.remove(node)


def shape_reads(path: Path) -> tuple[str, ...]:
    """What the graph's Shape nodes read, sorted (the manifest's ``graph.shape_reads``)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return tuple(sorted({n.input[0] for n in proto.graph.node if n.op_type == "Shape"}))


def commit_graph(layers: int, dtype: str, opset: int, value_dtype: str | None = None):
    """The tiny graph a device-resident cache commits with: it gathers the accepted rows of
    the block's K/V and writes each layer's rows straight into the cache (the backend binds
    every output to the cache memory at row P), so no K/V ever leaves the device.

    inputs ``present_keys, present_values [L, T, H_kv, D]``, ``rows [R]`` int64; outputs
    ``commit_key_i, commit_value_i [1, R, H_kv, D]``.
    """
    from onnx import TensorProto, helper

    elems = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "fp64": TensorProto.DOUBLE}
    elem = {"key": elems[dtype], "value": elems[value_dtype or dtype]}
    shape = [layers, "T", "H", "D"]
    nodes = [helper.make_node("Constant", [], ["ones"], value=helper.make_tensor(
        "ones", TensorProto.INT64, [layers], [1] * layers))]
    outputs = []
    for kv, src in (("key", "present_keys"), ("value", "present_values")):
        names = [f"commit_{kv}_{i}" for i in range(layers)]
        nodes.append(helper.make_node("Gather", [src, "rows"], [f"{kv}_rows"], axis=1))
        nodes.append(helper.make_node("Split", [f"{kv}_rows", "ones"], names, axis=0))
        outputs += [helper.make_tensor_value_info(n, elem[kv], [1, "R", "H", "D"])
                    for n in names]
    graph = helper.make_graph(
        nodes, "edgemtp_kv_commit",
        [helper.make_tensor_value_info("present_keys", elem["key"], shape),
         helper.make_tensor_value_info("present_values", elem["value"], shape),
         helper.make_tensor_value_info("rows", TensorProto.INT64, ["R"])],
        outputs)
    # IR 8 keeps the graph loadable by older onnxruntime builds (Jetson wheels lag behind)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=8, producer_name="edgemtp")
