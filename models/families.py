"""Per-family knowledge: which Hugging Face architectures edgemtp runs, and what differs.

All supported families share the Llama decoder layout (RMSNorm, rotary attention with
grouped KV heads, gated MLP); the differences that matter to a tree forward are listed here.
Rotary scaling (Llama-3 ``rope_type: llama3``, YaRN, ...) is computed by the model's own
rotary module, so every scaling transformers supports is supported.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgemtp.errors import ConfigError, UnsupportedModelError


@dataclass(frozen=True)
class Family:
    name: str
    qk_norm: bool = False        # per-head RMSNorm on q and k before rotary (Qwen3)
    sliding_window: bool = False  # the config may restrict attention to a window


FAMILIES: dict[str, Family] = {
    "llama": Family("llama"),
    "mistral": Family("mistral", sliding_window=True),
    "qwen2": Family("qwen2", sliding_window=True),
    "qwen3": Family("qwen3", qk_norm=True, sliding_window=True),
}


def family_for(config) -> Family:
    """The family of a ``transformers`` config, or a one-line error naming the supported ones."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        archs = ", ".join(getattr(config, "architectures", None) or []) or "unknown"
        raise UnsupportedModelError(
            f"model type {model_type!r} (architectures: {archs}) is not a supported causal LM; "
            f"supported families: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def attention_window(config, family: Family) -> int | None:
    """Tokens a query may see when the config turns a sliding window on for some layer, else
    None (a Qwen2/Qwen3 config with ``use_sliding_window`` but ``max_window_layers`` past its
    last layer: transformers' ``layer_types`` lists no sliding layer, and none slides).

    >>> from types import SimpleNamespace as C
    >>> fam = FAMILIES["qwen2"]
    >>> attention_window(C(sliding_window=32, use_sliding_window=True), fam)
    32
    >>> attention_window(C(sliding_window=32, use_sliding_window=True,
    ...                    layer_types=["full_attention"] * 2), fam)
    """
    if not family.sliding_window:
        return None
    window = getattr(config, "sliding_window", None)
    if family.name in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return None
    layers = getattr(config, "layer_types", None)
    if isinstance(layers, (list, tuple)) and layers and "sliding_attention" not in layers:
        return None
    return int(window) if window else None


def max_context(config, family: Family, requested: int | None = None) -> int:
    """Rows the KV cache needs: the model's position limit, the attention window (edgemtp
    attends to the whole cache, which equals windowed attention only inside the window), or
    what the user asked for if smaller."""
    limit = int(getattr(config, "max_position_embeddings", 0) or 2048)
    window = attention_window(config, family)
    if window:
        limit = min(limit, window)
    if requested is not None:
        if requested < 2:
            raise ConfigError(f"max context must be >= 2 tokens, got {requested}")
        limit = min(limit, int(requested))
    return limit


def missing_weights(model: str, loading_info: dict) -> str | None:
    """Why a checkpoint cannot stand for its model, from ``from_pretrained``'s
    ``output_loading_info``: the weights its config needs and it lacks, which transformers
    fills with random values (a tied LM head is not listed: it is the embedding). None where
    nothing is missing."""
    missing = sorted(loading_info.get("missing_keys") or ())
    if not missing:
        return None
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return (f"{model!r} lacks {len(missing)} weight{'s' if len(missing) > 1 else ''} its config "
            f"needs ({shown}); loading would fill them with random values: check the checkpoint "
            f"is complete (every shard, the LM head) and that its config's model_type is the "
            f"architecture the weights were trained as")
