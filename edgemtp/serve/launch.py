"""``edgemtp serve``'s options and start-up: check, load, bind, then run uvicorn until SIGTERM
or Ctrl-C. Only the standard library is imported until the command runs."""

from __future__ import annotations

import argparse
import ipaddress
import re
import signal
import socket
import sys

from ..errors import ConfigError, EdgeMTPError, ModelLoadError

LOOPBACK_NAMES = ("localhost",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; another "
                        "address without --api-key prints a warning)")
    s.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: any free)")
    s.add_argument("--parallel", type=int, default=2,
                   help="generations running at once, each on its own KV cache (default: 2)")
    s.add_argument("--queue", type=int, default=16,
                   help="requests waiting for a free slot; beyond them 429 (default: 16)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 and /metrics")
    s.add_argument("--api-key-file", default=None,
                   help="read the API key from this file (keeps it out of the process list)")
    s.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="browser origins that may call the API (CORS), comma-separated, e.g. "
                        "http://localhost:3000, or '*' for any (default: none; clients that "
                        "are not browsers need no such permission)")
    s.add_argument("--model-name", default=None,
                   help="the model's id in /v1/models and requests (default: the folder name)")
    s.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens a request may ask for (default: the context)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body (default: 1 MiB)")
    s.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a request may take, queue included; a generation still running "
                        "then ends with finish_reason 'length' (default: 300)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM or Ctrl-C, seconds in-flight requests get to finish; "
                        "then running ones answer with what they have (finish_reason length) "
                        "and queued ones get 503 (default: 30)")


def command(a: argparse.Namespace, load, config_of) -> int:
    from . import check_dependencies

    check_dependencies()
    _check(a)
    api_key = _api_key(a)
    base = config_of(a)  # the server's generation defaults; a bad flag fails before loading
    if a.max_tokens_limit is not None and base.max_new_tokens > a.max_tokens_limit:
        # the limit bounds every request, one that leaves out max_tokens too
        print(f"edgemtp: note: a request without max_tokens gets {a.max_tokens_limit} tokens "
              f"(--max-tokens-limit), not --max-new-tokens {base.max_new_tokens}",
              file=sys.stderr)
        base = base.with_(max_new_tokens=a.max_tokens_limit)
    if a.threads is None:
        a.threads = 1  # one intra-op thread per generation: --parallel of them share the cores
    model = load(a)
    model.keep_sessions = a.parallel  # its caches stay allocated, one per slot (as announced)
    if model.tokenizer is None:
        raise ModelLoadError(f"{a.model!r} has no tokenizer; the server takes text prompts")
    if base.drafter == "auto" and base.latency is None:
        # auto's latency curve, measured now on an idle model (or read from the user cache),
        # not under the first requests, which would both wait for it and distort it
        print("edgemtp: measuring this device's latency curve for the auto drafter ...",
              file=sys.stderr, flush=True)
        try:
            model.generate([0], base.with_(max_new_tokens=1, stop=()))
        except EdgeMTPError as e:  # then the first request measures it
            print(f"edgemtp: warning: could not measure it now ({e})", file=sys.stderr)
    model.check_config(base)  # defaults every request would be refused with: refused now
    for line in memory_lines(model, a.parallel, getattr(a, "device", "cpu") or "cpu",
                             _available()):
        print(line, file=sys.stderr, flush=True)
    sock = _bind(a.host, a.port)
    name = a.model_name or _default_name(a.model)
    return _run(model, sock, a, api_key, base, name)


def _run(model, sock: socket.socket, a, api_key, base, name: str) -> int:
    import uvicorn

    from .app import Settings, create_app
    from .requests import Limits

    context = model.backend.max_context
    limits = Limits(max_tokens=a.max_tokens_limit or context, max_context=context)
    settings = Settings(model_name=name, base=base, limits=limits, api_key=api_key,
                        max_body_bytes=a.max_body_bytes, timeout_s=a.timeout,
                        source=str(a.model), allowed_origins=origins(a.allowed_origins),
                        random_seed=getattr(a, "random_seed", False))
    app = create_app(model, settings, a.parallel, a.queue)
    scheduler = app.state.server.scheduler
    host, port = sock.getsockname()[:2]
    if not _is_loopback(a.host) and api_key is None:
        print(f"edgemtp: warning: listening on {a.host}, not loopback, without --api-key: "
              f"anyone who can reach port {port} can use this model", file=sys.stderr)
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    print(f"edgemtp: serving {name!r} at {url}/v1 (--parallel {a.parallel}, --queue {a.queue}, "
          f"context {context}); Ctrl-C or SIGTERM stops", flush=True)

    caught: list[int] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not scheduler.draining:
                print(f"edgemtp: stopping: finishing {scheduler.running} running and "
                      f"{scheduler.waiting} queued requests (up to {a.shutdown_timeout:g} s)",
                      file=sys.stderr, flush=True)
                scheduler.begin_shutdown(a.shutdown_timeout)  # new requests: 503
                caught.append(sig)
            super().handle_exit(sig, frame)

    # At --shutdown-timeout the generations still running stop after their current forward
    # pass and answer with what they have, and queued requests get a 503 (the scheduler's
    # deadline); uvicorn's own cancel, which answers a bare 500 and logs a traceback a request
    # (QA8a D1), is only a backstop for a forward pass that outlasts it by a minute.
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=a.shutdown_timeout + 60)
    # uvicorn raises the signal it caught again once it has shut down; with these handlers in
    # place that ends in the exit below (0 after SIGTERM, 130 after Ctrl-C, as a shell expects)
    # instead of the default kill or a KeyboardInterrupt
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    signal.signal(signal.SIGINT, lambda sig, frame: None)
    Server(config).run(sockets=[sock])
    print("edgemtp: stopped", file=sys.stderr, flush=True)
    return 130 if caught and caught[0] == signal.SIGINT else 0


def _available() -> int | None:
    """This host's MemAvailable (bytes), or None where /proc/meminfo is not there."""
    from edgemtp.doctor import _host

    return _host(None)["host_available"]


def memory_lines(model, parallel: int, device: str, available: int | None) -> list[str]:
    """What the K/V caches of ``parallel`` concurrent generations take at the model's max
    context (each slot keeps its own for the next request), and a warning where they would
    not fit this host's available memory (a CPU device; ``available``: bytes after the model
    loaded), naming what fits: the caches alone (``edgemtp doctor PACKAGE --parallel N``
    plans weights, caches and workspace together)."""
    one = model.kv_cache_bytes()
    if not one:
        return []
    from edgemtp.doctor import largest_rows, size

    context = model.backend.max_context
    native = model.backend.name == "native"
    lines = [f"edgemtp: KV cache: {parallel} x {size(one)} = {size(parallel * one)} at "
             f"{context} tokens (one per --parallel generation)"]
    if available is None or not device.startswith("cpu") or parallel * one <= available:
        return lines
    fixes = []
    fit_parallel = available // one
    if fit_parallel >= 1:
        fixes.append(f"--parallel {fit_parallel}")
    # the cache's bytes are not linear in its rows (the native one has a margin and blocks
    # of 16): the largest context whose caches really fit
    fit_context = largest_rows(lambda r: parallel * model.kv_cache_bytes(r) <= available,
                               context)
    if fit_context:
        fixes.append(f"--max-context {fit_context}")
    if native and getattr(model.backend, "kv_cache", None) == "fp16":
        q8 = model.backend.cache_bytes("int8")
        if parallel * q8 <= available:
            fixes.append(f"--kv-cache int8 ({size(q8)} each)")
    lines.append(f"edgemtp: warning: {parallel} full KV caches ({size(parallel * one)}) are "
                 f"more than this machine's available memory ({size(available)}): long "
                 f"generations running at once may run out of memory"
                 + (f"; fits: {' or '.join(fixes)}" if fixes else "")
                 + " (the caches alone; edgemtp doctor PACKAGE --parallel N plans the "
                   "weights and workspace too)")
    return lines


def origins(text: str | None) -> tuple[str, ...]:
    """``--allowed-origins``: "*" or origins as a browser sends them (scheme://host[:port])."""
    if text is None:
        return ()
    items = tuple(o.strip() for o in text.split(","))
    for o in items:
        if o != "*" and not re.fullmatch(r"https?://[^/\s:]+(:\d{1,5})?", o):
            raise ConfigError(f"--allowed-origins takes '*' or origins such as "
                              f"http://localhost:3000 (scheme://host[:port], no path), comma-"
                              f"separated; got {o!r}")
    return items


def _check(a) -> None:
    origins(a.allowed_origins)
    checks = [(a.parallel >= 1, f"--parallel must be >= 1, got {a.parallel}"),
              (a.queue >= 0, f"--queue must be >= 0, got {a.queue}"),
              (0 <= a.port <= 65535, f"--port must be in 0..65535, got {a.port}"),
              (a.max_body_bytes >= 1024, f"--max-body-bytes must be >= 1024, got "
                                         f"{a.max_body_bytes}"),
              (a.timeout > 0, f"--timeout must be > 0 seconds, got {a.timeout:g}"),
              (a.shutdown_timeout >= 0, f"--shutdown-timeout must be >= 0 seconds, got "
                                        f"{a.shutdown_timeout:g}"),
              (a.max_tokens_limit is None or a.max_tokens_limit >= 1,
               f"--max-tokens-limit must be >= 1, got {a.max_tokens_limit}"),
              (not (a.api_key and a.api_key_file), "give --api-key or --api-key-file, not both")]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _api_key(a) -> str | None:
    if a.api_key_file is None:
        key = a.api_key
    else:
        try:
            with open(a.api_key_file, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as e:
            raise ConfigError(f"cannot read --api-key-file {a.api_key_file!r}: "
                              f"{e.strerror}") from None
    if key is not None and (not key or any(c.isspace() for c in key)):
        raise ConfigError("the API key must be a non-empty string without spaces")
    return key


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket, or a one-line error (port taken, address not on this machine)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise EdgeMTPError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only "localhost" is known to stay on this machine
        return False


def _default_name(path: str) -> str:
    from pathlib import Path

    return Path(path.rstrip("/")).name or path
