"""The tree decoder in PyTorch: one forward that serves prefill, plain decoding and tree
steps, following the graph contract of DESIGN.md. It reuses the Hugging Face model's own
modules (embeddings, norms, projections, MLPs, rotary embedding), so weights and numerics are
the model's; only the attention plumbing (block tree mask + cache columns, sequence-major
K/V, mask slots) is ours.

Shapes: ``input_ids [1, T]``, ``position_ids [1, T]``, ``tree_mask [1, 1, T, T]`` bool,
``mask_embeds [k, d]``, past K/V per layer ``[1, P, H_kv, D]``, optionally ``past_len [1]``
(only the first ``past_len`` past rows are cache, the rest are masked: a backend may bind a
longer, fixed-size view of its cache); outputs logits ``[1, T, V]`` and the block's new K/V
per layer ``[1, T, H_kv, D]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .families import Family


class TreeDecoder(nn.Module):
    def __init__(self, hf_model: nn.Module, family: Family) -> None:
        super().__init__()
        self.model = hf_model.model
        self.lm_head = hf_model.lm_head
        self.family = family
        cfg = hf_model.config
        self.vocab_size = cfg.vocab_size
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads

    def embed(self, input_ids: torch.Tensor, mask_embeds: torch.Tensor) -> torch.Tensor:
        # ids >= vocab select mask slot id - vocab: no host-side embedding lookup needed
        is_mask = input_ids >= self.vocab_size
        tok = self.model.embed_tokens(input_ids.clamp(max=self.vocab_size - 1))
        slot = (input_ids - self.vocab_size).clamp(min=0, max=mask_embeds.shape[0] - 1)
        return torch.where(is_mask.unsqueeze(-1), mask_embeds.to(tok.dtype)[slot], tok)

    cache_axis = 1  # the past's row axis: [1, P, H_kv, D]

    def forward(self, input_ids, position_ids, tree_mask, mask_embeds, past_keys, past_values,
                past_len=None):
        hidden, new_keys, new_values = self.body(input_ids, position_ids, tree_mask, mask_embeds,
                                                 past_keys, past_values, past_len)
        return self.lm_head(hidden), new_keys, new_values

    def body(self, input_ids, position_ids, tree_mask, mask_embeds, past_keys, past_values,
             past_len=None):
        """The decoder without its LM head: the last hidden states ``[1, T, d]`` (after the
        final norm, what the LM head reads) and the block's new K/V per layer."""
        x = self.embed(input_ids, mask_embeds)
        cos, sin = self.model.rotary_emb(x, position_ids)
        mask = self.block_mask(tree_mask, past_keys[0].shape[self.cache_axis], past_len)
        new_keys, new_values = [], []
        for layer, pk, pv in zip(self.model.layers, past_keys, past_values):
            h, k, v = self._attention(layer, x, cos, sin, mask, pk, pv)
            new_keys.append(k)
            new_values.append(v)
            x = x + h
            x = x + self._mlp(layer, x)
        return self.model.norm(x), new_keys, new_values

    @staticmethod
    def block_mask(tree_mask, rows: int, past_len=None):
        """``[1, 1, T, rows + T]``: the cache is visible to every block row (the first
        ``past_len`` of the ``rows`` bound when it is given), then the block's own mask."""
        if past_len is None:
            cache_cols = torch.ones_like(tree_mask[..., :1]).expand(-1, -1, -1, rows)
        else:
            cache_cols = (torch.arange(rows, device=tree_mask.device) < past_len)
            cache_cols = cache_cols[None, None, None].expand(1, 1, tree_mask.shape[2], rows)
        return torch.cat([cache_cols, tree_mask], dim=-1)

    def _mlp(self, layer, x):
        return layer.mlp(layer.post_attention_layernorm(x))

    def _attention(self, layer, x, cos, sin, mask, past_k, past_v):
        # x: [1, T, d]; past_k/v: [1, P, H_kv, D] -> attention over [P + T] keys
        attn, t = layer.self_attn, x.shape[1]
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(1, t, self.n_heads, self.head_dim)
        k = attn.k_proj(h).view(1, t, self.n_kv, self.head_dim)
        v = attn.v_proj(h).view(1, t, self.n_kv, self.head_dim)
        if self.family.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        k_new = k.transpose(1, 2)                                   # [1, T, H_kv, D]
        keys = torch.cat([past_k, k_new], dim=1).transpose(1, 2)    # [1, H_kv, P+T, D]
        values = torch.cat([past_v, v], dim=1).transpose(1, 2)
        groups = self.n_heads // self.n_kv
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
        out = attn.o_proj(out.transpose(1, 2).reshape(1, t, -1))
        return out, k_new, v
