# A/B of the torch backend on CPU (stories260K), one version per process
# (bench/results/torch_step_cpu.md). Usage: python bench/bench_torch_ab.py SRC, SRC a source
# tree of edgemtp; prints JSON per method: [forward us/step, tok/s, BE]
import json
import sys
import time
from pathlib import Path
src = sys.argv[1]
sys.path.insert(0, src)
import importlib.util
spec = importlib.util.spec_from_file_location("edgemtp", f"{src}/edgemtp/__init__.py",
                                              submodule_search_locations=[f"{src}/edgemtp", src])
mod = importlib.util.module_from_spec(spec)
sys.modules["edgemtp"] = mod
spec.loader.exec_module(mod)
import torch; torch.set_num_threads(1)
from edgemtp import Model
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import story_prompts
STORIES = Path(__file__).resolve().parents[1] / ".." / "shared" / "models" / "stories260K"
m = Model.load(str(STORIES), threads=1)
prompts = story_prompts(12)
out = {}
for d, bc in (("none", 1), ("probe", 10), ("hybrid", 30)):
    m.generate(prompts[0], max_new_tokens=128, drafter=d, bc=max(bc, 10))
    fwd = steps = tok = 0; t0 = time.perf_counter()
    for p in prompts:
        r = m.generate(p, max_new_tokens=128, drafter=d, bc=max(bc, 10))
        fwd += r.stats.time_forward; steps += r.stats.forward_calls; tok += r.stats.new_tokens
    wall = time.perf_counter() - t0
    out[f"{d}@{bc}"] = (fwd / steps * 1e6, tok / wall, tok / steps)
print(json.dumps(out))
