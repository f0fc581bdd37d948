"""The tree decoder over a static KV cache: fixed shapes per step, so a CUDA graph can replay it.

:class:`~edgemtp.models.decoder.TreeDecoder` concatenates the past and the block's K/V in
every layer, an O(P) copy per step whose shapes change with P. Here, in the spirit of
gpt-fast, each session owns a cache ``[L, H_kv, S, D]`` preallocated on the device, and one
step

- writes the block's K/V in place at rows ``[P, P + T)`` (``index_copy_``; a commit later
  moves the accepted rows down to ``[P, P + r)``, nothing when they already are a prefix),
- attends over the first ``B`` cache rows (``B`` a length bucket >= ``P + T``): the committed
  columns ``< P`` are visible to every row, the block's columns follow the tree mask, the
  rest is masked; ``P`` is a device scalar, so the step's shapes depend on ``(T, B)`` only,
- groups the query heads by their KV head (``[1, H_kv, G * T, D]``) instead of repeating
  K/V ``G`` times: the same attention, no copy of the cache,
- reduces in the step (argmax, top-K log-probs), so the host reads back O(T * K).

Every input and output is a preallocated buffer of a :class:`StepGraph`; on CUDA the step is
captured once as a CUDA graph and replayed, elsewhere the same code runs eagerly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

from .decoder import TreeDecoder


class StaticTreeDecoder(TreeDecoder):
    """:class:`TreeDecoder` with a step over a preallocated cache (see the module doc).

    ``exact_attention`` (the torch backend's ``batch_invariant``): attention summed in
    float64 (:func:`exact_attention`), so a row's output does not depend on where in the
    cache its visible columns sit (a tree row's ancestors are scattered through the block;
    plain decoding's are contiguous)."""

    exact_attention = False

    def __init__(self, hf_model, family) -> None:
        super().__init__(hf_model, family)
        # q, k, v (and gate, up) as one matrix product each: fewer kernels per layer, bitwise
        # the same rows on CPU (tested); the modules' weights become views of the fused ones,
        # so the weights are not held twice
        self.qkv = [_fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
                    for layer in self.model.layers]
        self.gate_up = [_fuse(layer.mlp, ("gate_proj", "up_proj")) for layer in self.model.layers]
        # on a GPU in float16/bfloat16 the LM head writes float32 logits (see _logits)
        w = self.lm_head.weight
        self.fp32_logits = (w.is_cuda and w.dtype in (torch.float16, torch.bfloat16)
                            and self.lm_head.bias is None)

    def step(self, ids, pos, tree_mask, mask_embeds, p, k_cache, v_cache, width: int):
        """One block: ``ids``/``pos`` [T] int64, ``tree_mask`` [T, T] bool, ``mask_embeds``
        [k, d], ``p`` a 0-d int64 tensor (committed rows), caches ``[L, H_kv, S, D]``.
        Writes the block's K/V at rows ``[p, p + T)`` and returns the final hidden states
        [T, d] (after the norm) and the logits [T, V] in the model's dtype."""
        t = ids.shape[0]
        x = self.embed(ids[None], mask_embeds)
        cos, sin = self.model.rotary_emb(x, pos[None])
        rows = p + torch.arange(t, device=ids.device)
        col = torch.arange(width, device=ids.device)
        rel = col - p
        in_block = (rel >= 0) & (rel < t)
        mask = (col < p) | (in_block & tree_mask[:, rel.clamp(0, t - 1)])       # [T, B]
        groups = self.n_heads // self.n_kv
        mask = mask.repeat(groups, 1)[None, None]                     # [1, 1, G * T, B]
        if self.exact_attention:  # what exact_attention takes: the hidden columns, once a step
            mask = ~mask
        for i, layer in enumerate(self.model.layers):
            x = x + self._static_attention(layer, self.qkv[i], x, cos, sin, mask, rows,
                                           k_cache[i], v_cache[i], width, groups)
            x = x + self._fused_mlp(layer, self.gate_up[i],
                                     rms_norm(layer.post_attention_layernorm, x))
        h = rms_norm(self.model.norm, x)[0]
        return h, self._logits(h)

    def _logits(self, h):
        """The LM head. On a GPU in float16/bfloat16, one cuBLAS product whose float32 sums are
        written as float32 (``torch.mm``'s ``out_dtype``) rather than rounded to the model's
        dtype: a float16 logit near 20 is a multiple of 1/64, so two tokens a hair apart tie,
        and which one the T = 1 kernel and a block's kernel pick is a coin toss (the H100's
        fp16 divergences from plain decoding sat at logit gaps 0, 1/64 and 1/32). Where this
        torch cannot (CPU, or a torch without the overload), the model's own head; the first
        call of each step shape runs eagerly, so that is settled before any graph capture."""
        if self.fp32_logits:
            try:
                return torch.mm(h, self.lm_head.weight.t(), out_dtype=torch.float32)
            except (NotImplementedError, RuntimeError, TypeError):
                self.fp32_logits = False
        return self.lm_head(h)

    @staticmethod
    def _fused_mlp(layer, gate_up, h):
        mlp = layer.mlp
        if gate_up is None:
            return mlp(h)
        gate, up = F.linear(h, *gate_up).split([mlp.gate_proj.out_features,
                                                mlp.up_proj.out_features], dim=-1)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    def _static_attention(self, layer, qkv, x, cos, sin, mask, rows, k_cache, v_cache, width,
                          groups):
        attn, t, d = layer.self_attn, x.shape[1], self.head_dim
        h = rms_norm(layer.input_layernorm, x)
        if qkv is None:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        else:
            q, k, v = F.linear(h, *qkv).split([self.n_heads * d, self.n_kv * d, self.n_kv * d],
                                              dim=-1)
        q = q.view(1, t, self.n_heads, d)
        k = k.view(1, t, self.n_kv, d)
        v = v.view(1, t, self.n_kv, d)
        if self.family.qk_norm:
            q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
        # the rotary embedding of q and k in one pass (transformers' apply_rotary_pos_emb,
        # elementwise, so bitwise the same): on a GPU half the kernels
        qk = torch.cat([q, k], dim=2).transpose(1, 2)                 # [1, H + H_kv, T, D]
        qk = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
        q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]
        k_cache.index_copy_(1, rows, k[0].to(k_cache.dtype))                # [H_kv, S, D]
        v_cache.index_copy_(1, rows, v[0].transpose(0, 1).to(v_cache.dtype))
        # query head h reads KV head h // G: [1, H, T, D] -> [1, H_kv, G * T, D]
        q = q.reshape(1, self.n_kv, groups * t, d)
        if self.exact_attention:  # (mask: the hidden columns here)
            out = exact_attention(q, k_cache[None, :, :width], v_cache[None, :, :width], mask,
                                  attn.scaling)
        else:
            out = F.scaled_dot_product_attention(q, k_cache[None, :, :width],
                                                 v_cache[None, :, :width], attn_mask=mask,
                                                 scale=attn.scaling)
        out = out.reshape(1, self.n_heads, t, d).transpose(1, 2).reshape(1, t, -1)
        return attn.o_proj(out)


def _fuse(module, names: tuple[str, ...]):
    """``(weight, bias)`` of the Linear layers ``names`` of ``module`` stacked into one, their
    own weights re-pointed at views of it; None (and nothing changed) where they are not plain
    Linear layers of one dtype and device, or only some have a bias."""
    linears = [getattr(module, n, None) for n in names]
    if not all(type(m) is nn.Linear for m in linears):
        return None
    ws = [m.weight for m in linears]
    biased = [m.bias is not None for m in linears]
    if len({(w.dtype, w.device) for w in ws}) != 1 or len(set(biased)) != 1:
        return None
    with torch.no_grad():
        weight = torch.cat([w.detach() for w in ws])
        bias = torch.cat([m.bias.detach() for m in linears]) if biased[0] else None
        at = 0
        for m in linears:
            n = m.out_features
            m.weight = nn.Parameter(weight[at:at + n], requires_grad=False)
            if bias is not None:
                m.bias = nn.Parameter(bias[at:at + n], requires_grad=False)
            at += n
    return weight, bias


# transformers' RMSNorm modules that compute x * rsqrt(mean(x^2) + eps) in float32, cast back,
# then scale by the weight (not Gemma's 1 + weight)
_PLAIN_RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def rms_norm(norm, x):
    """``norm(x)`` for a transformers RMSNorm as one kernel (``F.rms_norm``); any other norm
    module is called as it is. A GPU step of a small model is bound by kernel launches, and
    transformers' RMSNorm is 8 of them. float32: bitwise transformers' result (tested).
    fp16/bf16: the weight is applied before the one rounding to the model's dtype, where
    transformers rounds first and then multiplies in fp16, so the two differ by at most about
    an ulp (tested); plain decoding and every drafter run this same function, so output still
    equals plain decoding."""
    if type(norm).__name__ not in _PLAIN_RMS_NORMS:
        return norm(x)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def exact_attention(q, k, v, hidden, scale: float):
    """Softmax attention with every sum in float64: the products of two float32 (or fp16,
    bf16) numbers are exact there, and a float64 sum of a few thousand of them is off by
    ~1e-16 relative whatever its order, far below what the cast back to the model's dtype
    rounds. So a row's output is the same whether its visible columns sit together (plain
    decoding) or scattered among masked ones (a tree row): a GPU kernel's summation order,
    which follows column positions, no longer shows. ``hidden``: True where a row may not
    look (the inverse of SDPA's ``attn_mask``); those columns weigh exactly 0.

    >>> q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    >>> mask = torch.tensor([[True, False, True], [True, True, True]])[None, None]
    >>> ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5)
    >>> bool(torch.allclose(exact_attention(q, k, v, ~mask, 0.5), ref, atol=1e-6))
    True
    """
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    s = s.masked_fill(hidden, float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (torch.matmul(e, v.double()) / e.sum(-1, keepdim=True)).to(q.dtype)
