"""``edgemtp serve``: the real server in a subprocess on a free loopback port, spoken to with
the official ``openai`` client and raw HTTP (httpx).

Every answer is checked against the Python API's own output for the same request (greedy, or
sampling with a seed), alone and with 20 requests at once; every bad request of the README's
table gets its status code and message, and ``/health`` still answers after it; a client
that leaves mid-stream frees its slot; SIGTERM under load finishes what was accepted and
exits 0.
"""

from __future__ import annotations

import json
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from edgemtp import GenerationConfig, Model  # noqa: E402
from edgemtp.tokenizer import text_after  # noqa: E402

from conftest import story_prompts  # noqa: E402
from test_chat import CHATML  # noqa: E402

KEY = "test-key-123"
PROMPTS = story_prompts(10)
START_S = 120  # a loaded CI machine can take a while to import and load


class Server:
    """``edgemtp serve PACKAGE --port 0 ARGS`` in a subprocess; its URL from its first line."""

    def __init__(self, package, *args: str, log_path, sigint: bool = False) -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edgemtp.cli", "serve", str(package), "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
            # (a pytest-xdist worker ignores SIGINT, and its children inherit that)
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if sigint
            else None)
        ready, _, _ = select.select([self.proc.stdout], [], [], START_S)
        line = self.proc.stdout.readline() if ready else ""
        found = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
        if not found:
            self.stop()
            raise AssertionError(f"the server did not start: {line!r}\n{self.stderr()}")
        self.url = found.group(1)

    def http(self, key: str | None = KEY) -> "httpx.Client":
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=60)

    def stderr(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def chat_pkg(stories_pkg, tmp_path_factory):
    """The stories package with a ChatML template, so chat completions run on the tiny model."""
    pkg = tmp_path_factory.mktemp("serve") / "stories-chat"
    shutil.copytree(stories_pkg, pkg)
    (pkg / "chat_template.jinja").write_text(CHATML)
    return pkg


@pytest.fixture(scope="module")
def ref(chat_pkg):
    """The Python API on the same package: what every answer must equal."""
    return Model.load(str(chat_pkg), threads=1)


@pytest.fixture(scope="module")
def server(chat_pkg, tmp_path_factory):
    s = Server(chat_pkg, "--parallel", "2", "--queue", "64", "--api-key", KEY,
               "--model-name", "stories", "--allowed-origins", "http://localhost:3000",
               log_path=tmp_path_factory.mktemp("log") / "main.log")
    yield s
    assert s.stop() == 0
    assert "Traceback" not in s.stderr()
    # the default drafter is auto: its latency curve is measured before the first request
    assert "measuring this device's latency curve for the auto drafter" in s.stderr()
    # what its two sessions' caches take (test_kv_memory checks the number)
    assert re.search(r"KV cache: 2 x [\d.]+ KiB = [\d.]+ KiB at 256 tokens", s.stderr())


@pytest.fixture(scope="module")
def limited(stories_pkg, tmp_path_factory):
    """One slot and one queue place, on the package with no chat template."""
    s = Server(stories_pkg, "--parallel", "1", "--queue", "1",
               log_path=tmp_path_factory.mktemp("log") / "limited.log")
    yield s
    assert s.stop() == 0
    assert "Traceback" not in s.stderr()


@pytest.fixture(scope="module")
def hurried(stories_pkg, tmp_path_factory):
    """A 0.05 s time limit: shorter than any 250-token generation (>= 250 forward passes)."""
    s = Server(stories_pkg, "--timeout", "0.05",
               log_path=tmp_path_factory.mktemp("log") / "hurried.log")
    yield s
    assert s.stop() == 0
    assert "Traceback" not in s.stderr()


def expected(ref, prompt, stop=(), **options) -> str:
    """The Python API's tokens as text after the prompt (a SentencePiece model's first token
    keeps its leading space, as OpenAI's API and vLLM give it), ending before the first stop
    string as OpenAI's API does."""
    config = GenerationConfig(**options, stop=tuple(stop))
    ids = ref.encode_chat(prompt) if isinstance(prompt, list) else ref.encode(prompt)
    text = text_after(ref.tokenizer, ids[-1], ref.generate(ids, config).token_ids)
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(cuts)] if cuts else text


def streamed(chunks, chat: bool) -> tuple[str, str, dict | None]:
    text, finish, usage = "", None, None
    for c in chunks:
        if c.usage is not None:
            usage = c.usage.model_dump()
        for choice in c.choices:
            text += (choice.delta.content or "") if chat else choice.text
            finish = choice.finish_reason or finish
    return text, finish, usage


# -- answers equal the Python API ------------------------------------------------------------

def test_completion_equals_the_python_api(server, ref):
    r = server.client().completions.create(model="stories", prompt=PROMPTS[0], max_tokens=40)
    gen = ref.generate(PROMPTS[0], max_new_tokens=40)
    assert r.choices[0].text == expected(ref, PROMPTS[0], max_new_tokens=40)
    assert r.choices[0].text.strip() == gen.text.strip() and r.choices[0].finish_reason == "length"
    u = r.usage.model_dump()
    assert (u["prompt_tokens"], u["completion_tokens"]) == (gen.stats.prompt_tokens, 40)
    assert u["total_tokens"] == u["prompt_tokens"] + 40
    assert u["forward_calls"] >= 1 and u["block_efficiency"] == pytest.approx(
        40 / u["forward_calls"], abs=1e-4)


def test_streamed_completion_equals_the_python_api(server, ref):
    chunks = server.client().completions.create(
        model="stories", prompt=PROMPTS[1], max_tokens=40, stream=True,
        stream_options={"include_usage": True})
    text, finish, usage = streamed(chunks, chat=False)
    assert text == expected(ref, PROMPTS[1], max_new_tokens=40)
    assert finish == "length" and usage["completion_tokens"] == 40 and usage["forward_calls"]


def test_a_browser_origin_given_with_allowed_origins_may_call_the_api(server, chat_pkg,
                                                                       tmp_path):
    """QA (qa8a D5): no CORS at all (OPTIONS 405, no Access-Control headers), so a web UI on
    localhost:3000 could not call the server; llama-server, vLLM (--allowed-origins) and
    Ollama can be told to allow it."""
    ui = "http://localhost:3000"
    with server.http(None) as h:
        pre = h.options("/v1/chat/completions", headers={
            "Origin": ui, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ui
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        r = h.post("/v1/completions", headers={"Origin": ui, "Authorization": f"Bearer {KEY}"},
                   json={"model": "stories", "prompt": PROMPTS[0], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ui
        refused = h.post("/v1/completions", headers={"Origin": ui}, json={"prompt": "x"})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ui
        other = h.options("/v1/chat/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("include", [True, False])
def test_with_include_usage_every_chunk_carries_usage(server, include):
    """QA (qa8a D4): OpenAI documents that with stream_options.include_usage "all other
    chunks will also include a usage field, but with a null value"; they had none."""
    body = {"model": "stories", "messages": [{"role": "user", "content": PROMPTS[1]}],
            "max_tokens": 8, "stream": True, "stream_options": {"include_usage": include}}
    with server.http() as h, h.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    if include:
        assert all("usage" in c for c in chunks)
        assert [c["usage"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    else:
        assert not any("usage" in c for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_the_python_api(server, ref, stream):
    messages = [{"role": "system", "content": "Tell a story."},
                {"role": "user", "content": PROMPTS[2]}]
    want = expected(ref, messages, max_new_tokens=32, bc=10)
    r = server.client().chat.completions.create(model="stories", messages=messages,
                                                max_tokens=32, stream=stream,
                                                extra_body={"bc": 10})
    got = streamed(r, chat=True)[0] if stream else r.choices[0].message.content
    assert got == want


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_text_before_them(server, ref, stream):
    full = expected(ref, PROMPTS[3], max_new_tokens=48)
    stop = full.split()[5]  # a word the greedy text reaches
    want = expected(ref, PROMPTS[3], stop=[stop], max_new_tokens=48)
    assert stop not in want and full.startswith(want)
    r = server.client().completions.create(model="stories", prompt=PROMPTS[3], max_tokens=48,
                                           stop=[stop], stream=stream)
    text, finish, _ = streamed(r, chat=False) if stream else (r.choices[0].text,
                                                              r.choices[0].finish_reason, None)
    assert (text, finish) == (want, "stop")


def test_a_stop_string_with_the_first_tokens_leading_space_is_cut(server, ref):
    # SentencePiece: the first generated token "▁was" reads " was" after the prompt, as
    # OpenAI's API and vLLM give it (and so does the Python API since 2026-11-29); the engine
    # stops on " was" there, and the server cuts it
    prompt = "Once upon a time, there"
    assert ref.generate(prompt, max_new_tokens=1, drafter="none").text == " was"
    for stream in (False, True):
        r = server.client().completions.create(model="stories", prompt=prompt, max_tokens=8,
                                               stop=[" was"], stream=stream)
        text, finish, _ = streamed(r, chat=False) if stream else (r.choices[0].text,
                                                                  r.choices[0].finish_reason, None)
        assert (text, finish) == ("", "stop"), stream
        r = server.client().completions.create(model="stories", prompt=prompt, max_tokens=3,
                                               stream=stream)
        text = streamed(r, chat=False)[0] if stream else r.choices[0].text
        assert text.startswith(" was"), (stream, text)


def test_sampling_with_a_seed_and_edgemtp_options(server, ref):
    options = dict(temperature=0.8, top_p=0.9, seed=7)
    extra = dict(bc=60, mask_tokens=2, drafter="probe")
    want = expected(ref, PROMPTS[4], max_new_tokens=40, **options, **extra)
    r = server.client().completions.create(model="stories", prompt=PROMPTS[4], max_tokens=40,
                                           **options, extra_body=extra)
    assert r.choices[0].text == want
    extra = dict(bc=30, drafter="hybrid", tree_cost="measured")
    r = server.client().completions.create(model="stories", prompt=PROMPTS[4], max_tokens=40,
                                           **options, extra_body=extra)
    assert r.choices[0].text == want  # sampling is exact whoever drafts


def test_sampling_without_a_seed_draws_a_random_one_and_says_which(server, ref):
    """QA (qa8a D6): a sampled request without seed gave the same text every time (the
    server's --seed 0); OpenAI's API and llama-server draw. usage.seed gives it back."""
    client, body = server.client(), dict(model="stories", prompt=PROMPTS[6], max_tokens=24,
                                         temperature=1.0)
    answers = [client.completions.create(**body) for _ in range(4)]
    seeds = [a.usage.model_dump()["seed"] for a in answers]
    assert len(set(seeds)) == 4 and all(isinstance(x, int) and x >= 0 for x in seeds)
    for a, seed in zip(answers[:2], seeds):  # each is the one its seed gives
        assert a.choices[0].text == expected(ref, PROMPTS[6], max_new_tokens=24,
                                             temperature=1.0, seed=seed)
    again = client.completions.create(**body, seed=seeds[0])
    assert again.choices[0].text == answers[0].choices[0].text
    greedy = client.completions.create(model="stories", prompt=PROMPTS[6], max_tokens=4)
    assert "seed" not in greedy.usage.model_dump()


def test_token_id_prompt_and_models_and_metrics(server, ref):
    ids = ref.encode(PROMPTS[5])
    with server.http() as h:
        r = h.post("/v1/completions", json={"prompt": ids, "max_tokens": 16})
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == expected(ref, PROMPTS[5], max_new_tokens=16)
        models = h.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["stories"]
        metrics = h.get("/metrics").text
    for name in ("edgemtp_requests_total", "edgemtp_completion_tokens_total",
                 "edgemtp_block_efficiency_bucket", "edgemtp_queue_length",
                 "edgemtp_request_duration_seconds_bucket", "edgemtp_forward_calls_total"):
        assert name in metrics
    assert re.search(r'edgemtp_requests_total\{endpoint="/v1/completions",status="200"\} '
                     r'[1-9]', metrics)


# -- concurrency -------------------------------------------------------------------------------

OPTIONS = [{}, {"bc": 10}, {"drafter": "pld"}, {"temperature": 0.8, "seed": 3},
           {"bc": 60, "mask_tokens": 2}]


def test_twenty_concurrent_requests_each_equal_their_solo_output(server, ref):
    jobs = [(PROMPTS[i % 10], OPTIONS[i % len(OPTIONS)], i % 2 == 1) for i in range(20)]
    options_of = {"temperature": "temperature", "seed": "seed"}

    def one(job):
        prompt, opts, stream = job
        std = {k: v for k, v in opts.items() if k in options_of}
        extra = {k: v for k, v in opts.items() if k not in options_of}
        r = server.client().completions.create(model="stories", prompt=prompt, max_tokens=48,
                                               stream=stream, extra_body=extra, **std)
        return streamed(r, chat=False)[0] if stream else r.choices[0].text

    with ThreadPoolExecutor(20) as pool:
        got = list(pool.map(one, jobs))
    want = [expected(ref, p, max_new_tokens=48, **o) for p, o, _ in jobs]
    assert got == want


@pytest.mark.slow
def test_sixty_concurrent_requests_chat_and_completions_all_options(server, ref):
    prompts = story_prompts(24)
    jobs = [(prompts[i % 24], OPTIONS[i % len(OPTIONS)], i % 2 == 1, i % 3 == 0)
            for i in range(60)]

    def one(job):
        prompt, opts, stream, chat = job
        std = {k: v for k, v in opts.items() if k in ("temperature", "seed")}
        extra = {k: v for k, v in opts.items() if k not in std}
        api = server.client()
        if chat:
            r = api.chat.completions.create(model="stories", max_tokens=64, stream=stream,
                                            messages=[{"role": "user", "content": prompt}],
                                            extra_body=extra, **std)
            return streamed(r, chat=True)[0] if stream else r.choices[0].message.content
        r = api.completions.create(model="stories", prompt=prompt, max_tokens=64,
                                   stream=stream, extra_body=extra, **std)
        return streamed(r, chat=False)[0] if stream else r.choices[0].text

    with ThreadPoolExecutor(60) as pool:
        got = list(pool.map(one, jobs))
    want = [expected(ref, [{"role": "user", "content": p}] if chat else p, max_new_tokens=64,
                     **o) for p, o, _, chat in jobs]
    assert got == want


# -- bad requests ------------------------------------------------------------------------------

LONG = "Once upon a time " * 200  # ~800 tokens: over the test package's 256-token context
BAD = [  # name, path, body (dict -> JSON, str/bytes -> raw), status, message fragment
    ("invalid JSON", "/v1/completions", b'{"prompt": "hi",', 400, "not valid JSON"),
    ("not an object", "/v1/completions", [1, 2], 400, "must be a JSON object"),
    ("max_tokens as a string", "/v1/completions", {"prompt": "a", "max_tokens": "5"}, 422,
     "invalid max_tokens: Input should be a valid integer"),
    ("prompt a number", "/v1/completions", {"prompt": 5}, 422, "invalid prompt"),
    ("temperature a string", "/v1/completions", {"prompt": "a", "temperature": "hot"}, 422,
     "invalid temperature"),
    ("stream a string", "/v1/completions", {"prompt": "a", "stream": "yes"}, 422,
     "invalid stream"),
    ("no prompt", "/v1/completions", {"max_tokens": 5}, 422, "invalid prompt: Field required"),
    ("no messages", "/v1/chat/completions", {"model": "stories"}, 422,
     "invalid messages: Field required"),
    ("messages a string", "/v1/chat/completions", {"messages": "hi"}, 422, "invalid messages"),
    ("message without role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 422,
     "invalid messages.0.role: Field required"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages is empty"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "a"}]},
     400, "messages.0.role 'wizard' is not a role this server accepts; use one of system, "
          "user, assistant, tool, developer"),
    ("a role the template refuses", "/v1/chat/completions",
     {"messages": [{"role": "tool", "content": "42"}]}, 400,
     "the chat template rejected the messages: unknown role tool"),
    ("user message without content", "/v1/chat/completions", {"messages": [{"role": "user"}]},
     400, "messages.0 (user) has no content; give a string or a list of text parts"),
    ("system message with null content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": None}]},
     400, "messages.1 (system) has no content"),
    ("developer message without content", "/v1/chat/completions",
     {"messages": [{"role": "developer"}, {"role": "user", "content": "a"}]}, 400,
     "messages.0 (developer) has no content"),
    # a lone surrogate (JSON's "\ud800", an undecodable byte) in any string of a message
    ("lone surrogate in a user message", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi \ud800"}]}, 400,
     "messages.0.content is not valid UTF-8 text (an undecodable byte or lone surrogate at "
     "character 3)"),
    ("lone surrogate in the system message", "/v1/chat/completions",
     {"messages": [{"role": "system", "content": "\udfff"}, {"role": "user", "content": "a"}]},
     400, "messages.0.content is not valid UTF-8 text"),
    ("lone surrogate as the role", "/v1/chat/completions",
     {"messages": [{"role": "\ud800", "content": "a"}]}, 400,
     "messages.0.role is not valid UTF-8 text"),
    ("lone surrogate in a text part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "text", "text": "\ud800"}]}]}, 400,
     "messages.0.content.1.text is not valid UTF-8 text"),
    ("lone surrogate in a streamed chat", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "\ud800"}], "stream": True}, 400,
     "messages.0.content is not valid UTF-8 text"),
    ("lone surrogate in a message's name", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a", "name": "\ud800"}]}, 400,
     "messages.0.name is not valid UTF-8 text"),
    ("lone surrogate in a field name inside a message", "/v1/chat/completions",
     {"messages": [{"role": "assistant", "tool_calls": [{"\ud800": 1}]}]}, 400,
     "a field name in messages.0.tool_calls.0 is not valid UTF-8 text"),
    ("lone surrogate in a stop string", "/v1/completions",
     {"prompt": "a", "stop": ["ok", "\ud800"]}, 400, "stop string 1 is not valid UTF-8 text"),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404,
     "'gpt-4' does not exist"),
    ("max_tokens 0", "/v1/completions", {"prompt": "a", "max_tokens": 0}, 400,
     "max_tokens must be between 1 and 256 (the model's context of 256 tokens), got 0"),
    ("max_tokens 10^9", "/v1/completions", {"prompt": "a", "max_tokens": 10**9}, 400,
     "max_tokens must be between 1 and 256"),
    ("prompt over the context", "/v1/completions", {"prompt": LONG}, 400,
     "this model's context is 256 tokens"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "the prompt is empty"),
    ("token id out of the vocabulary", "/v1/completions", {"prompt": [1, 10**6]}, 400,
     "prompt token ids must be in [0, 512)"),
    ("a batch of prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400,
     "one prompt per request"),
    ("n = 2", "/v1/completions", {"prompt": "a", "n": 2}, 400, "n=2 is not supported"),
    # (qa8a D8: it said "or use False", Python's spelling, where the JSON is false or 0)
    ("logprobs = 2", "/v1/completions", {"prompt": "a", "logprobs": 2}, 400,
     "logprobs=2 is not supported by this server (leave it out, or send false or 0)"),
    ("negative temperature", "/v1/completions", {"prompt": "a", "temperature": -1}, 400,
     "temperature must be >= 0"),
    ("unknown drafter", "/v1/completions", {"prompt": "a", "drafter": "magic"}, 400,
     "drafter must be one of probe"),
    ("bc too small for a plan", "/v1/completions", {"prompt": "a", "bc": 3, "drafter": "probe"},
     400,
     "block complexity 3 is too small"),
    ("tree cost on pld", "/v1/completions",
     {"prompt": "a", "drafter": "pld", "tree_cost": "measured"}, 400,
     "tree_cost only applies to drafter='hybrid', 'stand' or 'auto'"),
    ("too many stop strings", "/v1/completions", {"prompt": "a", "stop": list("abcde")}, 400,
     "stop takes at most 4 strings"),
    ("max_completion_tokens 0", "/v1/completions", {"prompt": "a", "max_completion_tokens": 0},
     400, "max_completion_tokens must be between 1 and 256"),
    ("max_completion_tokens 10^9 on chat", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 10**9}, 400,
     "max_completion_tokens must be between 1 and 256"),
    ("max_tokens -5 beside a valid max_completion_tokens", "/v1/completions",
     {"prompt": "a", "max_tokens": -5, "max_completion_tokens": 3}, 400,
     "max_tokens must be between 1 and 256"),
    ("max_completion_tokens a string", "/v1/completions",
     {"prompt": "a", "max_completion_tokens": "5"}, 422,
     "invalid max_completion_tokens: Input should be a valid integer"),
    ("10 MB body", "/v1/completions", b"x" * (10 << 20), 413, "over the server's limit"),
    # json.loads recurses: ~1000 levels is Python's recursion limit (was a 500)
    ("prompt nested 1000 deep", "/v1/completions",
     b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "nested too deeply"),
    ("unknown field nested 5000 deep", "/v1/completions",
     b'{"prompt": "a", "foo": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}", 400,
     "nested too deeply"),
    ("messages nested 1000 deep", "/v1/chat/completions",
     b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "nested too deeply"),
]


@pytest.mark.parametrize("name, path, body, status, message", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_its_status_and_message(server, name, path, body, status, message):
    with server.http() as h:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = h.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert message in error["message"]
        assert set(error) == {"message", "type", "param", "code"}
        assert h.get("/health").json()["status"] == "ok"


def test_api_key_wrong_missing_and_where_it_is_not_needed(server):
    for key in ("wrong", None):
        with server.http(key) as h:
            for r in (h.post("/v1/completions", json={"prompt": "a"}), h.get("/v1/models"),
                      h.get("/metrics")):
                assert r.status_code == 401
                assert r.json()["error"]["code"] == "invalid_api_key"
            assert h.get("/health").status_code == 200  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0
                      ).completions.create(model="stories", prompt="a")


def test_wrong_method_and_path(server):
    with server.http() as h:
        r = h.get("/v1/completions")
        assert r.status_code == 405 and "GET is not allowed" in r.json()["error"]["message"]
        r = h.get("/v2/nothing")
        assert r.status_code == 404 and "no route '/v2/nothing'" in r.json()["error"]["message"]
        r = h.post("/v1/embeddings", json={"input": "a"})  # (qa8a D8: "the API is under /v1")
        assert r.status_code == 404 and r.json()["error"]["message"] == (
            "no route '/v1/embeddings'; this server answers /v1/completions, "
            "/v1/chat/completions, /v1/models, /health and /metrics")


def test_chat_on_a_model_without_a_template(limited, stories_pkg):
    with limited.http(None) as h:
        r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}]})
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith(
            "the model 'stories' has no chat template; send a plain prompt")
        assert str(stories_pkg) not in r.text  # the server's own folder is none of its business
        assert h.get("/health").status_code == 200


def test_max_completion_tokens_on_completions_as_on_chat(server, ref):
    want = expected(ref, PROMPTS[8], max_new_tokens=3)
    messages = [{"role": "user", "content": PROMPTS[8]}]
    with server.http() as h:
        for path, body in (("/v1/completions", {"prompt": PROMPTS[8]}),
                           ("/v1/chat/completions", {"messages": messages})):
            for sizes in ({"max_completion_tokens": 3},
                          {"max_completion_tokens": 3, "max_tokens": 7}):  # the newer name wins
                r = h.post(path, json={**body, **sizes})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 3
        assert r.json()["choices"][0]["message"]["content"] == expected(ref, messages,
                                                                        max_new_tokens=3)
        r = h.post("/v1/completions", json={"prompt": PROMPTS[8], "max_completion_tokens": 3})
        assert r.json()["choices"][0]["text"] == want


def test_chat_roles_developer_assistant_and_text_parts(server, ref):
    system = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Once"}, {"role": "user", "content": PROMPTS[9]}]
    want = expected(ref, system, max_new_tokens=16)
    # developer is OpenAI's newer name for system; content may be text parts; an assistant
    # turn that only called tools may leave content out (null here, "" to the template)
    developer = [{"role": "developer", "content": [{"type": "text", "text": "Tell a "},
                                                   {"type": "text", "text": "story."}]},
                 *system[1:]]
    no_content = [*system[:2], {"role": "assistant", "tool_calls": []}, system[3]]
    with server.http() as h:
        r = h.post("/v1/chat/completions", json={"messages": developer, "max_tokens": 16})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
        r = h.post("/v1/chat/completions", json={"messages": no_content, "max_tokens": 16})
        assert r.status_code == 200, r.text
        empty = [*system[:2], {"role": "assistant", "content": ""}, system[3]]
        assert r.json()["choices"][0]["message"]["content"] == expected(ref, empty,
                                                                        max_new_tokens=16)


def test_one_model_by_id(server):
    with server.http() as h:
        listed = h.get("/v1/models").json()["data"][0]
        r = h.get("/v1/models/stories")
        assert r.status_code == 200 and r.json() == listed
        r = h.get("/v1/models/gpt-4")
        assert r.status_code == 404
        assert r.json() == {"error": {
            "message": "the model 'gpt-4' does not exist; this server has 'stories'",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
        assert h.get("/v1/models/org/stories").status_code == 404
        metrics = h.get("/metrics").text
    assert re.search(r'edgemtp_requests_total\{endpoint="/v1/models/\{model_id\}",'
                     r'status="404"\} [1-9]', metrics)
    with server.http(None) as h:
        assert h.get("/v1/models/stories").status_code == 401
    model = server.client().models.retrieve("stories")  # what openai's client calls
    assert (model.id, model.owned_by) == ("stories", "edgemtp")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client().models.retrieve("gpt-4")


def _metric(h, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", h.get("/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_client_leaving_mid_stream_frees_its_slot_at_once(server):
    with server.http() as h:
        before = _metric(h, "edgemtp_cancelled_total")
        with h.stream("POST", "/v1/completions", json={
                "prompt": PROMPTS[6], "max_tokens": 240, "stream": True, "bc": 60,
                "mask_tokens": 2}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert next(line for line in lines if line.startswith("data: "))
        # the response is closed: the worker stops after its current forward pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and h.get("/health").json()["running"]:
            time.sleep(0.02)
        assert h.get("/health").json()["running"] == 0
        assert _metric(h, "edgemtp_cancelled_total") == before + 1


def test_time_limit_ends_a_generation_with_length(hurried):
    with hurried.http(None) as h:
        for _ in range(5):  # a loaded machine may spend the 0.05 s before the slot (503)
            r = h.post("/v1/completions", json={"prompt": PROMPTS[7], "max_tokens": 250,
                                                 "drafter": "none"})
            assert r.status_code in (200, 503), r.text
            if r.status_code == 200:
                break
        else:
            assert r.json()["error"]["code"] == "queue_timeout"
            pytest.skip("the machine never reached the slot within 0.05 s")
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["stop_reason"] == "time_limit"
        assert 0 < body["usage"]["completion_tokens"] < 250
        assert h.get("/health").json()["running"] == 0


def test_a_full_queue_answers_429_with_retry_after(limited):
    # one slot and one queue place: of three requests at once, one is refused at once
    for _ in range(3):  # a loaded machine may be slow enough to serve them one by one
        barrier = threading.Barrier(3)

        def one(i):
            with limited.http(None) as h:
                barrier.wait()
                return h.post("/v1/completions", json={"prompt": PROMPTS[i], "max_tokens": 250,
                                                        "drafter": "none"})

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(one, range(3)))
        codes = sorted(r.status_code for r in answers)
        assert set(codes) <= {200, 429}, [r.text for r in answers]
        if 429 in codes:
            break
    refused = next(r for r in answers if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error"
    with limited.http(None) as h:
        assert h.get("/health").json() == {"status": "ok", "model": "stories", "running": 0,
                                           "queued": 0, "parallel": 1}


def test_sigterm_under_load_finishes_what_was_accepted_and_exits_0(chat_pkg, ref, tmp_path):
    s = Server(chat_pkg, "--parallel", "2", "--queue", "8", log_path=tmp_path / "term.log")
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def one(i):
        try:
            r = client.completions.create(model="stories-chat", prompt=PROMPTS[i],
                                          max_tokens=64, stream=i % 2 == 1)
        except openai.APIStatusError as e:
            # a request still on its way when SIGTERM lands was never accepted: it gets a
            # clean 503, not a dropped connection (on a loaded machine some arrive late)
            assert e.status_code == 503 and "shutting down" in str(e), e
            return None
        return streamed(r, chat=False)[0] if i % 2 else r.choices[0].text

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(one, i) for i in range(6)]
        with httpx.Client(base_url=s.url) as h:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and h.get("/health").json()["running"] < 2:
                time.sleep(0.01)
        s.proc.send_signal(signal.SIGTERM)
        got = [f.result() for f in futures]
    done = [i for i, g in enumerate(got) if g is not None]
    assert len(done) >= 2  # the two running when the signal came, at least, finished
    assert [got[i] for i in done] == [expected(ref, PROMPTS[i], max_new_tokens=64) for i in done]
    assert s.proc.wait(60) == 0
    assert "Traceback" not in s.stderr() and "edgemtp: stopped" in s.stderr()
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health")
    s.stop()


def test_past_the_shutdown_timeout_the_running_answer_and_the_queued_get_503(ref):
    """QA (qa8a D1): at --shutdown-timeout uvicorn cancelled what was still open: a bare
    text 500 and a CancelledError traceback in the log per request. Now the scheduler's own
    deadline comes first: the running generation stops after its current forward pass with
    what it has (the app answers finish_reason "length", usage.stop_reason "shutdown") and a
    queued request gets a 503 JSON error; uvicorn's cancel is a backstop a minute later.
    (The tiny model's 400 tokens take 0.2 s through a server: too quick to catch running
    there, so the real scheduler runs here with a reader that takes 5 ms a delta.)"""
    import asyncio

    from edgemtp.serve.requests import APIError
    from edgemtp.serve.scheduler import Job, Scheduler

    ids, config = ref.encode(PROMPTS[0]), GenerationConfig(max_new_tokens=400, drafter="none")
    whole = ref.generate(ids, config).token_ids

    async def scenario():
        sch = Scheduler(ref, parallel=1, queue=4)
        far = time.monotonic() + 600
        a, b = Job(ids, config, deadline=far), Job(ids, config, deadline=far)
        await sch.acquire(a)
        running = asyncio.ensure_future(sch.run(a, emit=lambda delta: time.sleep(0.005)))
        queued = asyncio.ensure_future(sch.acquire(b))
        await asyncio.sleep(0.3)
        assert sch.running == 1 and sch.waiting == 1 and not running.done()
        sch.begin_shutdown(0.1)
        with pytest.raises(APIError) as refused:
            sch.admit()  # new requests: 503 at once
        assert refused.value.status == 503
        result = await running
        with pytest.raises(APIError) as late:
            await queued
        sch.close()
        return a, result, late.value, sch

    a, result, late, sch = asyncio.run(scenario())
    assert a.timed_out and a.limit == "shutdown"
    assert 0 < len(result.token_ids) < len(whole) and whole[:len(result.token_ids)] == \
        result.token_ids
    assert late.status == 503 and late.code == "shutting_down", late
    assert sch.running == sch.waiting == 0


def test_ctrl_c_stops_the_server_as_sigterm_does_and_exits_130(chat_pkg, tmp_path):
    """QA (qa8a D3): README said Ctrl-C exits 0; it printed "edgemtp: interrupted" and exited
    130. Now both signals drain the same way and say "edgemtp: stopped"; Ctrl-C exits 130,
    as a shell expects of an interrupted command."""
    s = Server(chat_pkg, "--parallel", "1", log_path=tmp_path / "int.log", sigint=True)
    with httpx.Client(base_url=s.url) as h:
        assert h.get("/health").status_code == 200
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(60) == 130
    log = s.stderr()
    assert "Traceback" not in log and log.rstrip().splitlines()[-1] == "edgemtp: stopped", log
    s.stop()


# -- start-up ------------------------------------------------------------------------------------

def test_limits_and_refusals_hold_before_a_stream_begins(stories_pkg, tmp_path):
    """QA (server_report.md 1-4): a streamed request the package cannot run is a 400 before
    any event, as without streaming, and names the model, not the server's folder; the
    --max-tokens-limit bounds a request without max_tokens; a JSON integer of 5000 digits is
    a 400; "stream": null is no stream."""
    s = Server(stories_pkg, "--drafter", "none", "--max-tokens-limit", "8",
               "--model-name", "stories", log_path=tmp_path / "log")
    try:
        assert "a request without max_tokens gets 8 tokens (--max-tokens-limit)" in s.stderr()
        with s.http(None) as h:
            for body, message in (({"drafter": "heads"}, "has no learned heads"),
                                  ({"drafter": "probe", "bc": 64}, "top-31")):
                for stream in (False, True):
                    r = h.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4,
                                                         "stream": stream, **body})
                    assert r.status_code == 400, (stream, r.text)
                    error = r.json()["error"]
                    assert message in error["message"], error
                    assert str(stories_pkg) not in r.text and "ort0" not in r.text
                    assert "'stories'" in r.text or body["drafter"] != "heads", r.text
            # a stream that can run still streams
            with h.stream("POST", "/v1/completions", json={"prompt": "Once", "max_tokens": 4,
                                                           "stream": True}) as r:
                events = [x for x in r.iter_lines() if x]
            assert r.status_code == 200 and events[-1] == "data: [DONE]", events
            r = h.post("/v1/completions", json={"prompt": PROMPTS[0]})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
            big = b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}"
            r = h.post("/v1/completions", content=big,
                       headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
            r = h.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": None})
            assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
            assert h.get("/health").json()["running"] == 0
    finally:
        assert s.stop() == 0
    assert "Traceback" not in s.stderr()


def test_bad_flags_end_in_one_line_and_exit_2(stories_pkg):
    for flags, message in ((["--parallel", "0"], "--parallel must be >= 1"),
                           (["--timeout", "-1"], "--timeout must be > 0"),
                           (["--api-key", "a", "--api-key-file", "k"], "not both"),
                           (["--allowed-origins", "localhost:3000"],
                            "--allowed-origins takes '*' or origins such as"),
                           # defaults every request would be refused with: refused at start
                           (["--drafter", "heads"], "has no learned heads")):
        out = subprocess.run([sys.executable, "-m", "edgemtp.cli", "serve", str(stories_pkg),
                              *flags], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith("edgemtp: error: ") and message in out.stderr


def test_serve_dependencies_are_imported_only_by_serve(monkeypatch):
    code = ("import sys, edgemtp, edgemtp.cli; edgemtp.cli.build_parser(); "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'pydantic', "
            "'prometheus_client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "[]", out.stderr
    import importlib.util

    from edgemtp.errors import BackendUnavailableError
    from edgemtp.serve import check_dependencies

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvicorn" else real(name, *a))
    with pytest.raises(BackendUnavailableError, match="needs the Python package 'uvicorn'"):
        check_dependencies()


def test_only_loopback_hosts_count_as_safe():
    from edgemtp.serve.launch import _is_loopback

    assert all(_is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(_is_loopback(h) for h in ("0.0.0.0", "192.168.1.5", "::", "example.com"))


def test_an_answer_cut_by_the_full_context_finishes_with_length(server, ref):
    """qa10a S2: finish_reason "length" is how OpenAI clients tell a truncated answer, and
    only the max_tokens and time-limit cuts were tested; one that filled the model's context
    (256 tokens here; stories260K never says EOS) must say it too, streamed or not."""
    prompt = " ".join(PROMPTS[:6])
    room = 256 - len(ref.encode(prompt))
    assert 0 < room < 200
    client = server.client()
    r = client.completions.create(model="stories", prompt=prompt, max_tokens=200)
    u = r.usage.model_dump()
    assert (r.choices[0].finish_reason, u["stop_reason"], u["completion_tokens"]) == (
        "length", "max_context", room)
    text, finish, usage = streamed(client.completions.create(
        model="stories", prompt=prompt, max_tokens=200, stream=True,
        stream_options={"include_usage": True}), chat=False)
    assert (text, finish, usage["stop_reason"]) == (r.choices[0].text, "length", "max_context")


def test_the_earliest_stop_string_cuts_whichever_is_listed_first():
    """qa10a SV5: the server cut at the first-listed stop string found, not the earliest in
    the text, where one token completes two (the engine's own rule was tested alone)."""
    from edgemtp.serve.scheduler import first_stop

    assert first_stop("ab xy", ("xy", "ab")) == 0
    assert first_stop("ab xy", ("xy", "zz")) == 3
    assert first_stop("ab xy ab", ("ab",), start=1) == 6
    assert first_stop("ab", ("zz",)) is None


def test_a_request_picks_its_drafter_and_heads_over_the_servers_defaults():
    """QA (heads report D4, D5): a server run with --drafter heads --heads residual refused
    every request for another drafter ("heads only applies to ..."), and ignored a request's
    "heads"; the server's drafter-only defaults now give way to the request's drafter."""
    from edgemtp.serve.requests import APIError, CompletionRequest, Limits, generation_config

    base = GenerationConfig(drafter="heads", heads="residual", bc=10)
    limits = Limits(max_tokens=64, max_context=256)

    def config(**body):
        return generation_config(CompletionRequest(prompt="Once", **body), base, limits)

    assert config().heads == "residual"
    # --seed given (random_seed False): a request without seed samples with the server's
    assert config(temperature=1.0).seed == base.seed
    assert generation_config(CompletionRequest(prompt="a", temperature=1.0, seed=5), base,
                             limits, random_seed=True).seed == 5
    for drafter in ("none", "probe", "pld", "stand", "lade"):
        c = config(drafter=drafter)
        assert (c.drafter, c.heads) == (drafter, None)
    assert (config(drafter="hybrid").heads, config(drafter="auto").heads) == ("residual",) * 2
    assert config(heads="medusa").heads == "medusa"
    with pytest.raises(APIError, match="medusa or residual") as e:
        config(heads="bogus")
    assert e.value.status == 400
    with pytest.raises(APIError, match="heads .* only applies to"):
        config(drafter="pld", heads="medusa")  # what the request itself asked for
    lade = GenerationConfig(drafter="lade", lookahead=(3, 4, 1))
    assert generation_config(CompletionRequest(prompt="a", drafter="probe"), lade,
                             limits).lookahead is None


def test_a_max_tokens_refusal_names_where_its_limit_comes_from():
    # QA qa7 D10: the limit was always put down to --max-tokens-limit, also where the
    # model's context set it
    from edgemtp.serve.requests import APIError, CompletionRequest, Limits, generation_config

    for limits, why in ((Limits(max_tokens=64, max_context=256), "the server's "
                         "--max-tokens-limit"),
                        (Limits(max_tokens=256, max_context=256), "the model's context of "
                         "256 tokens")):
        with pytest.raises(APIError) as e:
            generation_config(CompletionRequest(prompt="Once", max_tokens=1000),
                              GenerationConfig(), limits)
        assert e.value.status == 400 and e.value.message == (
            f"max_tokens must be between 1 and {limits.max_tokens} ({why}), got 1000")
