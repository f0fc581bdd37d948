"""``edgemtp serve`` under load: 100 concurrent requests (40 distinct prompts, every other one
streamed) against ``--parallel`` 1 / 2 / 4, and the server's overhead per request against the
same generation through the Python API.

For each configuration (``PxT``: ``--parallel P`` with ``--threads T`` intra-op threads per
generation) a real server runs in a subprocess on a loopback port. A round sends all requests
at once (httpx, asyncio) to each configuration in turn, so machine drift from other work hits
them alike; the table reports the median round. Every answer is checked against the same
request alone through the Python API (greedy): a run counts failed (not 200), lost (no
answer) and different outputs.

Overhead: 20 requests one at a time to a ``--parallel 1`` server, each right after the same
generation through the Python API in this process (same package, same threads); the median
of the per-request differences.

    python bench/bench_serve.py                                   # stories260K, writes
                                                                  # bench/results/serve_cpu.*
    python bench/bench_serve.py --package out/pkg/smollm2 --chat --requests 40 \\
        --max-tokens 32 --configs 1x1,4x1 --label smollm2        # a chat model (Spec-Bench)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import hashlib
import threading

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / ".." / "shared"
STORIES = SHARED / "models" / "stories260K"


def prompts(chat: bool, n: int) -> list:
    if chat:  # Spec-Bench first turns, as one user message
        path = SHARED / "data" / "spec_bench" / "question.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [[{"role": "user", "content": r["turns"][0]}] for r in rows[:n]]
    path = SHARED / "data" / "stories_prompts.jsonl"
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines()][:n]


class Server:
    def __init__(self, package: str, parallel: int, threads: int, queue: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edgemtp.cli", "serve", package, "--port", "0",
             "--parallel", str(parallel), "--threads", str(threads), "--queue", str(queue)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 300)
        found = re.search(r"at (http://127\.0\.0\.1:\d+)/v1",
                          self.proc.stdout.readline() if ready else "")
        if not found:
            self.stop()
            sys.exit("bench_serve: the server did not start")
        self.url = found.group(1)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(120)

    def cpu_s(self) -> float:
        """CPU seconds the server process has used (user + system, all its threads)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cores_available(seconds: float = 0.5) -> float:
    """How many cores this machine gives us right now (at most 2): the rate of sha256 on two
    threads (hashlib releases the GIL) over the rate on one. On a shared machine it falls
    toward 1 or below as other work takes the cores; nothing then runs faster in parallel."""
    data = b"x" * (1 << 20)

    def rate(k: int) -> float:
        done, stop = [0] * k, time.perf_counter() + seconds

        def work(i: int) -> None:
            while time.perf_counter() < stop:
                hashlib.sha256(data).digest()
                done[i] += 1

        threads = [threading.Thread(target=work, args=(i,)) for i in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(done) / seconds

    return round(rate(2) / rate(1), 2)


def body(prompt, chat: bool, max_tokens: int, stream: bool) -> dict:
    key = "messages" if chat else "prompt"
    return {key: prompt, "max_tokens": max_tokens, "stream": stream}


async def one(client: httpx.AsyncClient, chat: bool, payload: dict) -> dict:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.perf_counter()
    first, text = None, ""
    try:
        if not payload["stream"]:
            r = await client.post(path, json=payload)
            if r.status_code != 200:
                return {"status": r.status_code}
            choice = r.json()["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
        else:
            async with client.stream("POST", path, json=payload) as r:
                if r.status_code != 200:
                    return {"status": r.status_code}
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for c in json.loads(line[6:])["choices"]:
                        piece = (c["delta"].get("content") or "") if chat else c["text"]
                        if piece and first is None:
                            first = time.perf_counter() - t0
                        text += piece
    except httpx.HTTPError as e:
        return {"status": type(e).__name__}
    return {"status": 200, "text": text, "latency": time.perf_counter() - t0, "ttft": first}


async def load_run(url: str, chat: bool, jobs: list[dict]) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=len(jobs), max_keepalive_connections=len(jobs))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(one(client, chat, j) for j in jobs))
        return answers, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def summarize(answers, wall, want, token_counts) -> dict:
    ok = [a for a in answers if a["status"] == 200]
    lat = [a["latency"] for a in ok]
    ttft = [a["ttft"] for a in ok if a.get("ttft") is not None]
    return {
        "wall_s": round(wall, 3),
        "tokens": sum(token_counts),
        "tokens_per_s": round(sum(token_counts) / wall, 1),
        "requests_per_s": round(len(ok) / wall, 2),
        "failed": sum(a["status"] != 200 for a in answers),
        "lost": len(want) - len(answers),
        "different": sum(a.get("text") != w for a, w in zip(answers, want) if a["status"] == 200),
        "latency_s": {f"p{q}": round(pct(lat, q), 3) for q in (50, 90, 99)} if lat else {},
        "ttft_s": {f"p{q}": round(pct(ttft, q), 3) for q in (50, 90)} if ttft else {},
    }


def overhead(package: str, chat: bool, prompt_list, max_tokens: int, n: int) -> dict:
    """The same generation through the Python API and through the server, alternating. Both
    start fresh and see the same requests in the same order, so the drafter state they learn
    across generations (rank calibration) stays the same and so do their forward calls."""
    from edgemtp import Model

    model, server = Model.load(package, threads=1), Server(package, 1, 1, 4)
    api, served, same_calls = [], [], 0
    try:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            for i in tqdm(range(n + 2), desc="overhead", leave=False):
                p = prompt_list[i % len(prompt_list)]
                t0 = time.perf_counter()
                res = (model.chat if chat else model.generate)(p, max_new_tokens=max_tokens)
                t1 = time.perf_counter()
                r = client.post("/v1/chat/completions" if chat else "/v1/completions",
                                json=body(p, chat, max_tokens, False))
                t2 = time.perf_counter()
                assert r.status_code == 200, r.text
                if i >= 2:  # two warm-up pairs
                    api.append(t1 - t0)
                    served.append(t2 - t1)
                    same_calls += r.json()["usage"]["forward_calls"] == res.stats.forward_calls
    finally:
        server.stop()
    diff = [s - a for a, s in zip(api, served)]
    return {"requests": n, "same_forward_calls": same_calls,
            "api_median_ms": round(1e3 * statistics.median(api), 2),
            "server_median_ms": round(1e3 * statistics.median(served), 2),
            "overhead_median_ms": round(1e3 * statistics.median(diff), 2),
            "overhead_median_pct": round(100 * statistics.median(
                d / a for d, a in zip(diff, api)), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", default=str(ROOT / "out" / "pkg" / "stories260K"),
                    help="exported package (stories260K is exported there if missing)")
    ap.add_argument("--chat", action="store_true", help="chat completions on Spec-Bench")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--distinct", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--configs", default="1x1,2x1,4x1,1x2",
                    help="PARALLELxTHREADS per server (default: 1x1,2x1,4x1,1x2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--overhead-requests", type=int, default=20)
    ap.add_argument("--label", default="stories260K")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_cpu"),
                    help="writes OUT.json (merged by label) and OUT.md")
    a = ap.parse_args()

    from edgemtp import Model

    if not Path(a.package).is_dir():
        from edgemtp.cli import main as cli

        cli(["export", str(STORIES), "-o", a.package, "--quiet"])
    configs = [tuple(int(v) for v in c.split("x")) for c in a.configs.split(",")]
    prompt_list = prompts(a.chat, a.distinct)
    jobs = [body(prompt_list[i % len(prompt_list)], a.chat, a.max_tokens, i % 2 == 1)
            for i in range(a.requests)]
    model = Model.load(a.package, threads=1)
    print(f"solo outputs of {len(prompt_list)} prompts (Python API)...", file=sys.stderr)
    solo = [model.chat(p, max_new_tokens=a.max_tokens) if a.chat else
            model.generate(p, max_new_tokens=a.max_tokens) for p in prompt_list]
    want = [solo[i % len(solo)].text for i in range(a.requests)]
    counts = [len(solo[i % len(solo)].token_ids) for i in range(a.requests)]

    servers = {c: Server(a.package, *c, queue=a.requests) for c in configs}
    load, cores = [os.getloadavg()[0]], []
    runs: dict[str, list] = {f"{p}x{t}": [] for p, t in configs}
    try:
        for _ in tqdm(range(a.rounds), desc="rounds"):
            cores.append(cores_available())
            for c, s in servers.items():  # interleaved: every round visits every config
                cpu = s.cpu_s()
                answers, wall = asyncio.run(load_run(s.url, a.chat, jobs))
                run = summarize(answers, wall, want, counts)
                cpu = s.cpu_s() - cpu
                run |= {"cpu_s": round(cpu, 2), "cores_used": round(cpu / wall, 2),
                        "cpu_ms_per_token": round(1e3 * cpu / run["tokens"], 3)}
                runs[f"{c[0]}x{c[1]}"].append(run)
                load.append(os.getloadavg()[0])
    finally:
        for s in servers.values():
            s.stop()
    over = overhead(a.package, a.chat, prompt_list, a.max_tokens, a.overhead_requests)
    result = {
        "label": a.label, "package": os.path.relpath(a.package, ROOT), "chat": a.chat,
        "requests": a.requests,
        "distinct": len(prompt_list), "max_tokens": a.max_tokens, "rounds": a.rounds,
        "cpus": os.cpu_count(), "load_avg_1min": [round(v, 2) for v in load],
        "cores_available": cores,
        "date": time.strftime("%Y-%m-%d %H:%M"), "runs": runs, "overhead": over,
    }
    write(result, Path(a.out))


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def write(result: dict, out: Path) -> None:
    path = out.with_suffix(".json")
    everything = json.loads(path.read_text()) if path.is_file() else {}
    everything[result["label"]] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(everything, indent=1) + "\n")
    lines = []
    for r in everything.values():
        base = median_run(r["runs"].get("1x1", next(iter(r["runs"].values()))))["tokens_per_s"]
        lines += [f"## {r['label']} ({'chat' if r['chat'] else 'completions'}, {r['requests']} "
                  f"concurrent requests, {r['distinct']} distinct prompts, every other streamed, "
                  f"max_tokens {r['max_tokens']})", "",
                  f"{r['date']}, {r['cpus']} CPUs shared with other work (1-min load average "
                  f"over the runs: {min(r['load_avg_1min'])}..{max(r['load_avg_1min'])}; "
                  f"cores this sandbox could use, probed before each round: "
                  f"{', '.join(map(str, r['cores_available']))}); "
                  f"{r['rounds']} interleaved rounds, the median round shown (all rounds' "
                  f"tok/s in brackets). Cores used: the server's CPU seconds over the run's "
                  f"wall time.", "",
                  "| --parallel x --threads | tok/s | vs 1x1 | req/s | latency p50 / p90 / p99 "
                  "(s) | TTFT p50 (s) | cores used | CPU ms / token | failed | lost | "
                  "different |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, runs in r["runs"].items():
            m = median_run(runs)
            every = ", ".join(str(x["tokens_per_s"]) for x in runs)
            lat = " / ".join(str(m["latency_s"].get(f"p{q}", "-")) for q in (50, 90, 99))
            lines.append(f"| {name} | {m['tokens_per_s']} [{every}] | "
                         f"{m['tokens_per_s'] / base:.2f}x | {m['requests_per_s']} | {lat} | "
                         f"{m['ttft_s'].get('p50', '-')} | {m['cores_used']} | "
                         f"{m['cpu_ms_per_token']} | {sum(x['failed'] for x in runs)} | {sum(x['lost'] for x in runs)} | "
                         f"{sum(x['different'] for x in runs)} |")
        o = r["overhead"]
        lines += ["", f"Overhead ({o['requests']} requests one at a time, --parallel 1, "
                      f"non-streaming, against the Python API in the bench process, the same "
                      f"forward calls in {o['same_forward_calls']} of them): median "
                      f"generation {o['api_median_ms']} ms through the API, "
                      f"{o['server_median_ms']} ms through the server; median difference "
                      f"{o['overhead_median_ms']} ms = {o['overhead_median_pct']} %.", ""]
    out.with_suffix(".md").write_text("# edgemtp serve on CPU\n\n`python bench/bench_serve.py`"
                                      " (see its docstring).\n\n" + "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
