"""A llama-architecture GGUF written from a Hugging Face llama folder (safetensors and a
SentencePiece tokenizer), as llama.cpp's ``convert_hf_to_gguf.py`` and ``llama-quantize``
would, minimally: the tests' GGUF files of other block types than the shared Q4_1 file.
Written by a QA pass (``/work/scratch/qa5/mkgguf.py``), kept here for the tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (the inverse of transformers' GGUF loader's)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_llama_gguf(src: Path, out: Path, kind: str = "F32", head: str | None = None) -> None:
    """``src`` (config.json, model.safetensors, tokenizer.model) as ``out``, its matrices in
    ``kind`` (F32, F16, Q8_0, Q4_0, Q4_1, ...; a row that does not fill whole blocks: F16),
    norms in F32, the embedding tied unless the folder has an ``lm_head``; ``head``: the LM
    head's type (the tied embedding's, or output.weight's), as llama-quantize's
    ``--output-tensor-type`` (default ``kind``)."""
    import gguf
    import sentencepiece as spm
    from gguf import GGMLQuantizationType as Q
    from safetensors.numpy import load_file

    cfg = json.loads((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(src.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // nh)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta")
                         or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_vocab_size(cfg["vocab_size"])
    sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    kinds = [(sp.is_unknown, gguf.TokenType.UNKNOWN), (sp.is_control, gguf.TokenType.CONTROL),
             (sp.is_byte, gguf.TokenType.BYTE), (sp.is_unused, gguf.TokenType.UNUSED)]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([sp.id_to_piece(i) for i in range(sp.vocab_size())])
    w.add_token_scores([sp.get_score(i) for i in range(sp.vocab_size())])
    w.add_token_types([next((t for test, t in kinds if test(i)), gguf.TokenType.NORMAL)
                       for i in range(sp.vocab_size())])
    w.add_bos_token_id(cfg.get("bos_token_id", 1))
    w.add_eos_token_id(cfg.get("eos_token_id", 2))
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    qt = Q[kind]

    def put(name: str, arr: np.ndarray, t=qt) -> None:
        arr = arr.astype(np.float32)
        if arr.ndim == 1:
            t = Q.F32
        if arr.shape[-1] % gguf.GGML_QUANT_SIZES[t][0]:
            t = Q.F16
        if t in (Q.F32, Q.F16):
            w.add_tensor(name, arr if t == Q.F32 else arr.astype(np.float16))
        else:
            data = gguf.quants.quantize(arr, t)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=t)

    tied = "lm_head.weight" not in sd
    put("token_embd.weight", sd["model.embed_tokens.weight"], Q[head] if head and tied else qt)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], nh))
        put(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], nkv))
        put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd:
        put("output.weight", sd["lm_head.weight"], Q[head] if head else qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
