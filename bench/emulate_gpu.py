"""Which plans the drafters pick, and what they would gain, on a GPU's latency curve: run on
the CPU, timed on a virtual clock.

A GPU lease is rare, and `auto`'s choices depend on the device's t(T) curve and the host time
of each kind of step. This bench runs real generations (a real package on a CPU backend, every
token computed and checked against plain decoding) while every clock the engine, the drafters
and ``auto`` read is a virtual one: a forward pass of T rows costs what a measured GPU curve
says (``t_ms`` of a ``bench_gpu.py`` summary, rows padded to the next power of two as the torch
backend's CUDA graphs are, plus a fixed binding time a step), and everything else costs this
host's real time, scaled by ``--host-scale`` (a faster host: the H200's host ran the hybrid's
drafting in ~0.4x this VM's time). ``auto`` measures its latency curve under the same clock,
so it sees the GPU's curve, and learns its host times and compute slope from virtual time.

A GPU's own costs beyond the curve can be charged as guesses: ``--topk-ms`` a step that
asks for a top-K, ``--plan-ms`` a tree mask new to the device, ``--eager-ms`` and
``--capture-ms`` a step shape's first (eager) and second (captured) use in a session, on the
torch backend's shape keys; each method's new shapes and captures are counted. What it cannot
show: the curve's growth with the cache, and fp16 numerics (the tokens are the CPU package's).
So its speed-ups are the plans' and the host's share of a GPU run under those assumptions, a
way to compare policies between leases, never a GPU measurement
(``bench/results/emulated_h100_smollm2.md`` sets it beside the H100's run).

    python bench/emulate_gpu.py out/SmolLM2-135M-Instruct-GGUF-int4 \
        --curve bench/results/gpu_summary_h100_gguf_2026-11-28.json:smollm2-gguf/fp16 \
        --drafters pld,stand,lade,hybrid,auto --bc 60 --out bench/results/emulated_h100
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgemtp import Model  # noqa: E402
from edgemtp.config import GenerationConfig  # noqa: E402
from edgemtp.errors import EdgeMTPError  # noqa: E402
from edgemtp.runtimes.torch_backend import (  # noqa: E402
    BUCKET, PAD_TO, SLACK, attention_width, parse_span, span_name, step_rows)

PROMPTS_FILE = ROOT / "bench" / "data" / "gpu_prompts_smollm2.json"
# a GPU step's costs beyond the curve, charged as guesses (Extras): --NAME-ms
EXTRA_COSTS = (
    ("topk", "charged to every step that asks for a top-K (H100, SmolLM2 fp16: probing's "
             "steps ran ~0.28 ms over the emulation at --host-scale 0.5)"),
    ("plan", "charged to every step whose plan mask is new to the device (LADE at BC 60 "
             "there: ~0.3 ms)"),
    ("capture", "charged at a step shape's second use in a session, where the torch backend "
                "captures its CUDA graph"),
    ("eager", "charged beyond the curve at a step shape's first use in a session, which the "
              "torch backend runs eagerly (no graph yet)"))


class VirtualClock:
    """``host_scale`` x (real time outside forward passes) + (modelled forward time)."""

    def __init__(self, host_scale: float, real=time.perf_counter) -> None:
        self.host_scale, self.real = host_scale, real
        self.real_in_forward = 0.0
        self.model_time = 0.0

    def __call__(self) -> float:
        return self.host_scale * (self.real() - self.real_in_forward) + self.model_time

    def forward_took(self, real: float, modelled: float) -> None:
        self.real_in_forward += real
        self.model_time += modelled


class Curve:
    """A GPU's t(T) in seconds from ``t_ms`` (T -> ms at powers of two up to 64): T rows cost
    the bucket they are padded to; past 64 rows (a prefill), each further 64 adds a tenth of
    t(64) (launch-bound: a 135M model's 256-row prefill is nearly one 64-row step)."""

    def __init__(self, t_ms: dict, binding_ms: float) -> None:
        self.t = {int(k): float(v) / 1e3 for k, v in t_ms.items()}
        self.binding = binding_ms / 1e3
        if sorted(self.t) != [1, 2, 4, 8, 16, 32, 64]:
            raise ValueError(f"--curve: t_ms must hold T = 1, 2, 4, ..., 64, got "
                             f"{sorted(self.t)}")

    def __call__(self, rows: int) -> float:
        tp = step_rows(rows, buckets=True)
        if tp > PAD_TO:
            return self.t[PAD_TO] * (1.0 + 0.1 * (tp // PAD_TO - 1)) + self.binding
        return self.t[tp] + self.binding


class Extras:
    """Costs a GPU step may carry beyond the curve, per step (seconds): ``topk`` where the
    step asks for a top-K (the curve is measured without one), ``plan`` where its tree mask
    is not among the last MASKS the device holds (a new plan: the torch backend's device
    copies of plan masks, kept by identity, before they went from pinned memory)."""

    MASKS = 512

    def __init__(self, topk_ms: float = 0.0, plan_ms: float = 0.0,
                 capture_ms: float = 0.0, eager_ms: float = 0.0) -> None:
        self.topk, self.plan, self.capture = topk_ms / 1e3, plan_ms / 1e3, capture_ms / 1e3
        self.eager = eager_ms / 1e3
        self._held: dict[int, object] = {}  # id -> the mask (held: ids are not reused)
        self.events = {"shapes": 0, "captures": 0}  # first uses and captures, all sessions

    def captured(self, shapes: dict, key: tuple) -> float:
        """A session's step of shape ``key``: the torch backend runs a shape eagerly at its
        first use (charged ``eager`` beyond the curve) and captures its CUDA graph at its
        second (charged ``capture``)."""
        uses = shapes[key] = shapes.get(key, 0) + 1
        if uses == 1:
            self.events["shapes"] += 1
            return self.eager
        if uses == 2:
            self.events["captures"] += 1
            return self.capture
        return 0.0

    def __call__(self, tree_mask, topk: int) -> float:
        extra = self.topk if topk else 0.0
        if self.plan and id(tree_mask) not in self._held:
            extra += self.plan
            if len(self._held) >= self.MASKS:
                del self._held[next(iter(self._held))]
            self._held[id(tree_mask)] = tree_mask
        return extra


class EmuSession:
    """A CPU session whose forward passes are charged the GPU curve's time."""

    rows_from = False  # the torch backend computes every prompt row (no rows_from)

    def __init__(self, inner, clock: VirtualClock, curve: Curve, extras: Extras,
                 span: int = BUCKET["cuda"], rows: int = 512 + SLACK) -> None:
        self._inner, self._clock, self._curve, self._extras = inner, clock, curve, extras
        self._span, self._rows = span, rows  # the torch backend's on a GPU
        self.last_run_s = None
        self._shapes: dict[tuple, int] = {}  # the step shapes this session met, and uses

    def forward(self, input_ids, position_ids, tree_mask, mask_embeds=None, **kwargs):
        t0 = time.perf_counter()
        p = self._inner.cache_len
        out = self._inner.forward(input_ids, position_ids, tree_mask, mask_embeds, **kwargs)
        t, topk = len(input_ids), kwargs.get("topk", 0)
        # the torch backend's step shape on a GPU: its padded rows, its cache span
        tp = step_rows(t, buckets=True)
        key = (tp, attention_width(p + tp, self._span, self._rows), 1 if mask_embeds is None
               else len(mask_embeds), topk)
        modelled = (self._curve(t) + self._extras(tree_mask, topk)
                    + self._extras.captured(self._shapes, key))
        self._clock.forward_took(time.perf_counter() - t0, modelled)
        self.last_run_s = modelled
        return out

    def __getattr__(self, name):
        return getattr(self._inner, name)


class EmuBackend:
    """The CPU backend, its sessions charged the GPU curve; no identity (``auto``'s latency
    curve is measured, under the virtual clock, never read from the cache of real curves)."""

    def __init__(self, inner, clock: VirtualClock, curve: Curve,
                 extras: Extras | None = None, span: int = BUCKET["cuda"],
                 rows: int = 512 + SLACK) -> None:
        self._inner, self._clock, self._curve = inner, clock, curve
        self._extras = Extras() if extras is None else extras
        self._span, self._rows = span, rows

    def session(self):
        return EmuSession(self._inner.session(), self._clock, self._curve, self._extras,
                          self._span, self._rows)

    def identity(self):
        return None

    def __getattr__(self, name):
        return getattr(self._inner, name)


def install_clock(clock: VirtualClock):
    """Every clock the engine, the drafters and the latency measurement read becomes
    ``clock``; returns a function that puts the real ones back."""
    import edgemtp.drafters.auto as auto
    import edgemtp.drafters.hybrid as hybrid
    import edgemtp.drafters.stand as stand
    import edgemtp.engine as engine
    import edgemtp.latency as latency
    shim = types.SimpleNamespace(perf_counter=clock)
    saved = [(m, "perf_counter", m.perf_counter) for m in (engine, hybrid, stand)] + \
        [(m, "time", m.time) for m in (auto, latency)]
    for mod, name, _ in saved:
        setattr(mod, name, clock if name == "perf_counter" else shim)

    def restore() -> None:
        for mod, name, value in saved:
            setattr(mod, name, value)
    return restore


def load_curve(spec: str) -> tuple[dict, str]:
    path, _, entry = spec.partition(":")
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--curve {spec}: cannot read {path} ({e})") from None
    entries = d.get("entries", {})
    if entry not in entries or "t_ms" not in entries[entry]:
        raise ValueError(f"--curve {spec}: no entry {entry!r} with t_ms in {path} "
                         f"(entries: {', '.join(entries)})")
    return entries[entry]["t_ms"], f"{entries[entry].get('device', '?')} {entry}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("package", help="a package a CPU backend runs (the native int4 one)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--curve", required=True,
                    help="FILE:ENTRY, a bench_gpu.py summary and its model/dtype entry")
    ap.add_argument("--binding-ms", type=float, default=0.1,
                    help="host time a GPU step adds to t(T) (H100, SmolLM2 fp16: plain "
                         "decoding's step 2.20 ms against t(1) = 2.06)")
    ap.add_argument("--host-scale", type=float, default=1.0,
                    help="this host's time outside forward passes is multiplied by this")
    for name, text in EXTRA_COSTS:
        ap.add_argument(f"--{name}-ms", type=float, default=0.0, help=text)
    ap.add_argument("--drafters", default="pld,stand,lade,hybrid,auto")
    ap.add_argument("--bc", default="60")
    ap.add_argument("--prompts-file", default=str(PROMPTS_FILE),
                    help="token-id prompts, {\"prompts\": [[ids]]} (default: SmolLM2's "
                         "Spec-Bench chat prompts; bench/data/gpu_prompts.json: stories260K's)")
    ap.add_argument("--prompts", type=int, default=13)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--auto-param", action="append", default=[],
                    help="NAME=VALUE: an AutoDrafter class attribute (or a constant of its "
                         "module, such as WHOLE_MIN_T1) for this run")
    ap.add_argument("--span", default=span_name(BUCKET["cuda"]),
                    help="the torch backend's attention span on the GPU whose step shapes "
                         "are counted (EDGEMTP_ATTENTION_SPAN: doubling, full or a multiple "
                         "of 64; default: the CUDA default)")
    ap.add_argument("--max-context", type=int, default=None,
                    help="the GPU session's max context (default: bench_gpu.py's, the "
                         "longest prompt + new tokens + 64, at least 512)")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    a = ap.parse_args(argv)
    try:
        span = parse_span(a.span, "--span")
    except EdgeMTPError as e:
        ap.error(str(e))
    for name, value in (("--prompts", a.prompts), ("--new-tokens", a.new_tokens)):
        if value < 1:
            ap.error(f"{name} must be >= 1, got {value}")
    costs = {name: getattr(a, f"{name}_ms") for name, _ in EXTRA_COSTS}
    if a.host_scale <= 0 or min(a.binding_ms, *costs.values()) < 0:
        ap.error("--host-scale must be > 0 and --binding-ms, "
                 + ", ".join(f"--{n}-ms" for n in costs) + " >= 0")
    try:
        t_ms, curve_name = load_curve(a.curve)
        curve = Curve(t_ms, a.binding_ms)
    except (ValueError, TypeError, AttributeError) as e:
        ap.error(str(e))
    import edgemtp.drafters.auto as auto_module
    for kv in a.auto_param:
        name, _, value = kv.partition("=")
        owner = next((o for o in (auto_module.AutoDrafter, auto_module) if hasattr(o, name)),
                     None)
        if owner is None:
            ap.error(f"--auto-param {kv}: neither AutoDrafter nor its module has {name!r}")
        try:
            setattr(owner, name, type(getattr(owner, name))(float(value)))
        except ValueError:
            ap.error(f"--auto-param {kv}: {value!r} is not a number")
    clock = VirtualClock(a.host_scale)
    install_clock(clock)
    try:
        model = Model.load(a.package, backend=a.backend)
    except EdgeMTPError as e:
        ap.error(str(e))
    extras = Extras(**{f"{n}_ms": v for n, v in costs.items()})
    try:
        prompts = json.loads(Path(a.prompts_file).read_text())["prompts"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"--prompts-file {a.prompts_file}: not a prompts file ({e})")
    context = a.max_context or max(512, max(map(len, prompts)) + a.new_tokens + 64)
    model.backend = EmuBackend(model.backend, clock, curve, extras, span, context + SLACK)
    vocab = model.backend.vocab_size
    if any(not 0 <= t < vocab for p in prompts for t in p):
        ap.error(f"--prompts-file {a.prompts_file}: token ids outside this model's "
                 f"vocabulary of {vocab}")
    warm, timed = prompts[:a.warmup], prompts[a.warmup:a.warmup + a.prompts]
    if len(timed) < a.prompts:
        timed = prompts[:a.prompts]  # (fewer prompts than asked: warm-up ones again)
    methods = [("plain", "none", 1)] + [
        (f"{d}@{bc}", d, int(bc)) for d in a.drafters.split(",") for bc in a.bc.split(",")]
    res = {}
    plain_tokens = None
    for label, drafter, bc in methods:
        cfg = GenerationConfig(drafter=drafter, bc=bc, max_new_tokens=a.new_tokens)
        for p in warm:
            model.generate(p, cfg)
        tokens, calls, vtime, outs, picked = 0, 0, 0.0, [], {}
        events = dict(extras.events)
        for p in timed:
            t0 = clock()
            r = model.generate(p, cfg)
            vtime += clock() - t0
            tokens += r.stats.new_tokens
            calls += r.stats.forward_calls
            outs.append(list(r.token_ids))
            for k, v in (getattr(r.stats, "steps_by_kind", None) or {}).items():
                picked[k] = picked.get(k, 0) + v
        if plain_tokens is None:
            plain_tokens = outs
        same = sum(o == q for o, q in zip(outs, plain_tokens))
        shapes = {k: v - events[k] for k, v in extras.events.items()}  # in the timed prompts
        res[label] = dict(tokens=tokens, forward_calls=calls, be=tokens / calls,
                          tps=tokens / vtime, identical=[same, len(outs)], picked=picked,
                          shapes=shapes)
        base = res["plain"]["tps"]
        print(f"{label:>10}: BE {tokens / calls:.3f}  virtual tok/s {tokens / vtime:7.1f}  "
              f"x plain {tokens / vtime / base:.3f}  identical {same}/{len(outs)}  "
              f"new shapes {shapes['shapes']}, captures {shapes['captures']}"
              + (f"  picked {picked}" if picked else ""), flush=True)
    if a.out:
        meta = dict(command=" ".join(sys.argv), curve=curve_name, t_ms=t_ms,
                    binding_ms=a.binding_ms, host_scale=a.host_scale, topk_ms=a.topk_ms,
                    plan_ms=a.plan_ms, capture_ms=a.capture_ms, eager_ms=a.eager_ms,
                    span=span_name(span), max_context=context, package=a.package,
                    prompts=len(timed), new_tokens=a.new_tokens,
                    date=time.strftime("%Y-%m-%d %H:%M"), auto_param=a.auto_param)
        Path(a.out + ".json").write_text(json.dumps(dict(meta=meta, results=res), indent=1))
        base = res["plain"]["tps"]
        lines = [f"# Emulated on {curve_name}'s curve (virtual clock; not a GPU measurement)",
                 "", f"`{meta['command']}`, {meta['date']}. Forward passes cost the curve "
                 f"(t_ms {t_ms}) + {a.binding_ms} ms, + {a.topk_ms} ms a step with a "
                 f"top-K, + {a.plan_ms} ms a step with a plan new to the device, + "
                 f"{a.capture_ms} ms a graph capture, + {a.eager_ms} ms a step shape's "
                 f"first (eager) run, step shapes keyed on {span_name(span)} attention "
                 f"spans (max context {context}); the rest is this host's time x "
                 f"{a.host_scale}.", "",
                 "| method | BE | virtual tok/s | x plain | identical | new shapes | "
                 "captures |",
                 "|---|---:|---:|---:|---:|---:|---:|"]
        for label, r in res.items():
            lines.append(f"| {label} | {r['be']:.3f} | {r['tps']:.1f} | "
                         f"{r['tps'] / base:.3f} | {r['identical'][0]}/{r['identical'][1]} | "
                         f"{r['shapes']['shapes']} | {r['shapes']['captures']} |")
        Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
