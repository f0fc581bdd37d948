"""The main job: run plain greedy decoding and mask-token probing on the same prompts and
backend, check they produce the same tokens, and print the text and the speed-up figures."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from .config import GenerationConfig
from .errors import EdgeMTPError

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
FALLBACK_PROMPTS = ["Once upon a time, there was a little girl named", "The cat sat on the"]

CONFIGS = [  # (label, options); the first one is the reference
    ("greedy (no drafter)", dict(drafter="none")),
    ("probe k=1 BC=10", dict(bc=10)),
    ("probe k=1 BC=30", dict(bc=30)),
    ("probe k=1 BC=60", dict(bc=60)),
    ("probe k=2 BC=60 dynamic", dict(bc=60, mask_tokens=2)),
]


def story_prompts(n: int) -> list[str]:
    path = SHARED / "data" / "stories_prompts.jsonl"
    if not path.is_file():
        return FALLBACK_PROMPTS[:n]
    with open(path) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()][:n]


def run_demo(a) -> int:
    from tqdm import tqdm

    from .api import Model

    model_path = a.model or str((SHARED / "models" / "stories260K").resolve())
    if a.model is None and not Path(model_path).is_dir():
        raise EdgeMTPError("no default model found at ../shared/models/stories260K; give --model")
    model = Model.load(model_path, backend=a.backend, device=a.device, dtype=a.dtype,
                       max_context=a.max_context, trust_remote_code=a.trust_remote_code,
                       threads=a.threads)
    prompts = story_prompts(a.prompts)
    rows, reference = [], None
    runs = tqdm(total=len(CONFIGS) * len(prompts), desc="generating", unit="run", file=sys.stderr)
    for label, opts in CONFIGS:
        config = GenerationConfig(max_new_tokens=a.max_new_tokens, **opts)
        results = []
        for p in prompts:
            results.append(model.generate(p, config))
            runs.update()
        if reference is None:
            reference = results
        same = all(r.token_ids == g.token_ids for r, g in zip(results, reference))
        rows.append((label, results, same))
    runs.close()

    print(f"model: {model_path}\nprompt: {prompts[0]}\n")
    print(rows[-1][1][0].text.strip() + "\n")
    base_tps = statistics.median(r.stats.tokens_per_second for r in rows[0][1])
    print(f"{'method':<26}{'tokens':>8}{'fwd calls':>11}{'BE':>7}{'tok/s':>9}{'speed-up':>10}"
          f"  lossless")
    for label, results, same in rows:
        toks = sum(r.stats.new_tokens for r in results)
        calls = sum(r.stats.forward_calls for r in results)
        tps = statistics.median(r.stats.tokens_per_second for r in results)
        print(f"{label:<26}{toks:>8}{calls:>11}{toks / calls:>7.2f}{tps:>9.1f}"
              f"{tps / base_tps:>9.2f}x  {'yes' if same else 'NO'}")
    print(f"\n{len(prompts)} prompts, {a.max_new_tokens} new tokens, backend {a.backend} on "
          f"{a.device}. BE = tokens per forward call (prefill included); speed-up = median "
          f"tok/s over greedy on the same backend.")
    if not all(same for _, _, same in rows):
        print("edgemtp: error: probing output differs from greedy decoding", file=sys.stderr)
        return 1
    return 0
