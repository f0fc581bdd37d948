"""The decode loop: prefill, then steps of propose -> forward -> verify -> commit.

A :class:`Generation` is an iterator of the tokens each forward pass commits, so callers can
stream; its :attr:`Generation.result` holds the tokens, stop reason and :class:`Stats`.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Callable

import numpy as np

from .backend import Backend, Session, StepOut
from .config import GenerationConfig
from .drafters import Drafter, get as drafter_spec, make_drafter
from .errors import ConfigError
from .metrics import Stats
from .plans import Plan
from .verify import Verifier

Decode = Callable[[list[int]], str]
PREFILL_CHUNK = 128  # prompt rows per prefill forward: attention over a chunk's rows and the
                     # rows before it only (a fraction of the full square), and a smaller
                     # scores tensor; a multiple of MLAS's 128-row chunks
BLOCK_CACHE = 256  # per-plan step buffers a generation keeps (oldest out first)


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids only, the stopping token included
    stop_reason: str      # eos | stop_string | max_new_tokens | max_context | closed
    stats: Stats
    text: str = ""  # the decode of token_ids as it reads after the prompt (a SentencePiece
    #                 tokenizer's leading space kept): a stop string (and the rest of its
    #                 token) kept


class Stopper:
    """Decides after every single token, so a stop can land mid-way through an accepted path.
    Stop strings are looked for in the generated text as it grows, token by token, through
    the incremental detokenizer the streams use (:class:`~edgemtp.tokenizer.TextStream`: a
    character split over several byte tokens counts once its last byte is in, and the text
    stays whole however a byte-fallback decoder treats a run with a cut character)."""

    def __init__(self, config: GenerationConfig, eos_ids: tuple[int, ...], room: int,
                 decode: Decode | None, before: int | None = None) -> None:
        if config.stop and decode is None:
            raise ConfigError("stop strings need a tokenizer to decode the output")
        self.eos = frozenset(config.eos_token_ids if config.eos_token_ids is not None else eos_ids)
        self.max_new, self.room = config.max_new_tokens, room
        self.stop = config.stop
        self.longest = max((len(s) for s in self.stop), default=0)
        self.text = ""  # the generated text so far (whole characters), where stop strings are
        self._stream = None
        if self.stop:
            from .tokenizer import TextStream

            # the text as it reads after the prompt's last token: a SentencePiece tokenizer
            # keeps the first generated token's leading space (" was" stops at the first token)
            self._stream = TextStream(_Decoder(decode), before)
        self.tokens: list[int] = []
        self.reason: str | None = None

    def push(self, tokens: list[int]) -> int:
        """Append the tokens one forward committed, up to the one generation ends with (if
        any); returns how many were kept. Per token, EOS wins over a stop string, which wins
        over ``max_new_tokens`` and then a full cache."""
        start, end, reason = len(self.tokens), len(tokens), None
        for i, tok in enumerate(tokens):
            n = start + i + 1
            reason = ("eos" if tok in self.eos
                      else "stop_string" if self._stream is not None and self._ends_stop(tok)
                      else "max_new_tokens" if n >= self.max_new
                      else "max_context" if n >= self.room else None)
            if reason:
                end = i + 1
                break
        self.tokens.extend(tokens[:end])
        self.reason = reason
        return end

    def _ends_stop(self, token: int) -> bool:
        """Whether ``token`` completes a stop string in the generated text."""
        delta = self._stream.push([token])
        if not delta:
            return False
        look = max(len(self.text) - self.longest + 1, 0)  # a new one ends in the delta
        self.text += delta
        return any(self.text.find(s, look) >= 0 for s in self.stop)


class _Decoder:
    """A decode function as the tokenizer :class:`~edgemtp.tokenizer.TextStream` reads."""

    def __init__(self, decode: Decode) -> None:
        self.decode = decode


def step_topk(drafter) -> int:
    """The most candidates a row any of ``drafter``'s steps asks the backend for."""
    return max(int(getattr(drafter, "topk", 0) or 0), int(getattr(drafter, "topk_max", 0) or 0))


class Generation:
    """One generation in progress. Iterate to run it; each item is the list of tokens one
    forward pass committed (the first comes from prefill).

    It runs on its own :class:`~edgemtp.backend.Session` (a fresh one from the backend unless
    one is given), so generations in progress at the same time never share a KV cache.
    ``on_done(session)`` is called once, when the generation ends or is closed, so a caller
    can hand the session to the next generation.
    """

    def __init__(self, backend: Backend, config: GenerationConfig, prompt_ids,
                 decode: Decode | None = None, memory: dict | None = None,
                 session: Session | None = None,
                 on_done: Callable[[Session], None] | None = None) -> None:
        self.backend, self.config = backend, config
        self._decode = decode  # result.text: the output as it reads after the prompt
        self.prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        if self.prompt.size == 0:
            raise ConfigError("the prompt is empty; give at least one token")
        if np.any(self.prompt < 0) or np.any(self.prompt >= backend.vocab_size):
            raise ConfigError(f"prompt token ids must be in [0, {backend.vocab_size}), "
                              f"got min {self.prompt.min()} max {self.prompt.max()}")
        if self.prompt.size >= backend.max_context:
            raise ConfigError(f"the prompt has {self.prompt.size} tokens; the max context is "
                              f"{backend.max_context}, which leaves no room to generate")
        width = drafter_spec(config.drafter).budget(config)
        self.drafter: Drafter = make_drafter(backend, config, memory)
        # learned heads read the rows' last hidden states; other drafters never ask for them
        self._hidden = bool(getattr(self.drafter, "hidden", False))
        check = getattr(backend, "check_step", None)
        if check is not None:  # what the steps will ask the package's graph for, refused now
            check(step_topk(self.drafter), self._hidden)  # (not at the first step: a stream's
            #                                                400 comes before any event)
        self.verifier = Verifier(config)
        self.stopper = Stopper(config, backend.eos_token_ids,
                               backend.max_context - self.prompt.size, decode,
                               int(self.prompt[-1]) if self.prompt.size else None)
        self.stats = Stats(bc=width, mask_tokens=self.drafter.mask_tokens,
                           prompt_tokens=self.prompt.size)
        picked = getattr(self.drafter, "picked", None)  # auto's steps per kind, kept current
        if isinstance(picked, dict):
            self.stats.steps_by_kind = picked
        self._blocks: dict[int, tuple] = {}  # id(plan) -> plan, N, ids, positions, mask rows
        self._root: int | None = None
        self.session = session if session is not None else backend.session()
        self._on_done = on_done

    # -- iteration --------------------------------------------------------------------------

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # (``with model.generation(...) as gen:``: the cache goes back however
        #               the block is left)

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        if self.stopper.reason is not None:
            self.close()
            raise StopIteration
        try:
            new = self._prefill() if self._root is None else self._step()
        except BaseException:
            self.close()  # the session's cache is mid-step: never hand it on as it is
            raise
        if self.done:
            self.close()
        return new

    def close(self) -> None:
        """Give the session back (once); a closed generation that has not finished stops
        with reason ``closed``."""
        session, self.session = self.session, None
        if session is None:
            return
        if self.stopper.reason is None:
            self.stopper.reason = "closed"
        finish = getattr(self.drafter, "finish", None)  # a drafter's end-of-generation upkeep
        if finish is not None:
            finish()
        session.reset()
        if self._on_done is not None:
            self._on_done(session)

    def run(self) -> GenerationResult:
        for _ in self:
            pass
        return self.result

    @property
    def done(self) -> bool:
        return self.stopper.reason is not None

    @property
    def result(self) -> GenerationResult:
        tokens = list(self.stopper.tokens)
        text = ""
        if self._decode is not None and tokens:
            from .tokenizer import text_after

            text = text_after(_Decoder(self._decode), int(self.prompt[-1]), tokens)
        return GenerationResult(tokens, self.stopper.reason or "running", self.stats, text)

    # -- stages -----------------------------------------------------------------------------

    def _prefill(self) -> list[int]:
        # block: [prompt, m_1..m_k], causal; mask j sits at position t - 1 + j. A long
        # prompt goes in chunks of PREFILL_CHUNK rows first, committed as they come, the last
        # chunk with the masks: the same chunks whatever the drafter, so plain decoding and
        # every drafter start from the same cache
        t0 = perf_counter()
        b, t = self.session, self.prompt.size
        b.reset()
        self.drafter.start(self.prompt)
        k = self.drafter.mask_tokens  # (after start: auto sets it per generation)
        c0, seen = 0, []  # seen: the earlier chunks' outputs, which drafters observe too
        # a drafter that reads no prompt row's outputs (drafter.prompt_rows False) gets the
        # last prompt row's and its mask rows' only, where the session can leave rows out (the
        # native backend's: the LM head is a fifth of a row's weights, and a top-K adds a
        # log-softmax over the vocabulary)
        skip = (not getattr(self.drafter, "prompt_rows", True)
                and getattr(b, "rows_from", False) is True)
        if t > PREFILL_CHUNK:
            chunk_mask = np.tril(np.ones((PREFILL_CHUNK, PREFILL_CHUNK), dtype=bool))
        while t - c0 > PREFILL_CHUNK:
            chunk = self.prompt[c0:c0 + PREFILL_CHUNK]
            part = b.forward(chunk, c0 + np.arange(PREFILL_CHUNK), chunk_mask, None,
                             topk=self.drafter.topk, hidden=self._hidden,
                             **({"rows_from": PREFILL_CHUNK} if skip else {}))
            seen.append(_copy_rows(part))
            b.commit(np.arange(chunk.size))
            c0 += chunk.size  # (the prefill counts as one forward call, however chunked)
        n = t - c0  # prompt rows in the last chunk
        ids = np.concatenate([self.prompt[c0:], self.backend.vocab_size + np.arange(k)])
        causal = np.tril(np.ones((n + k, n + k), dtype=bool))
        out = b.forward(ids, c0 + np.arange(n + k), causal, self.drafter.mask_embeds(),
                        topk=self.drafter.topk, full_logits=self.verifier.sample,
                        hidden=self._hidden, **({"rows_from": n - 1} if skip else {}))
        root = self.verifier.target(out, n - 1)
        new = self._emit([root])
        if not self.done:
            b.commit(np.arange(n))
            self._root = root
            whole = _join_rows([*seen, out]) if seen else out
            self.drafter.observe(whole, np.arange(t, t + k), new, np.arange(t))
        self.stats.forward_calls += 1
        self.stats.time_prefill += perf_counter() - t0
        return new

    def _step(self) -> list[int]:
        st, b = self.stats, self.session
        t0 = perf_counter()
        plan, tokens = self.drafter.propose(self._root)                              # propose
        ids, positions, mask_rows = self._block(plan, tokens, b.cache_len)
        embeds = self.drafter.mask_embeds()
        t1 = perf_counter()
        out = b.forward(ids, positions, plan.tree_mask, embeds,                       # forward
                        topk=self.drafter.topk, full_logits=self.verifier.sample,
                        hidden=self._hidden)
        t2 = perf_counter()
        accepted, bonus = self.verifier.walk(plan, tokens, out)                      # verify
        t3 = perf_counter()
        new = self._emit([int(tokens[a]) for a in accepted] + [bonus])                # commit
        path = np.array([0, *accepted], dtype=np.int64)
        if not self.done:
            b.commit(path)
            self._root = bonus
        t4 = perf_counter()
        if not self.done:
            self.drafter.observe(out, mask_rows[accepted[-1] if accepted else 0], new, path)
        st.forward_calls += 1
        st.accept_lengths.append(len(accepted))
        st.time_draft += (t1 - t0) + (perf_counter() - t4)
        run = b.last_run_s
        if run is not None:  # the runtime's run alone; the backend's binding is overhead
            st.time_forward += run
            st.time_bind += t2 - t1 - run
        else:
            st.time_forward += t2 - t1
        st.time_verify += t3 - t2
        st.time_commit += t4 - t3
        return new

    def _emit(self, tokens: list[int]) -> list[int]:
        new = tokens[:self.stopper.push(tokens)]
        self.stats.new_tokens += len(new)
        return new

    def _block(self, plan: Plan, tokens: np.ndarray, p: int):
        # ids [tokens, mask slots, extra rows] and positions (template + P) of one step,
        # written into buffers kept per plan, and the plan's mask rows per node [N, k]; mask
        # slot j of every node is id vocab + j - 1, node-major
        # (keyed by identity, cheaper than hashing a plan; an entry keeps its plan alive, and
        # the table is bounded: lookup drafters make a new plan most steps)
        block = self._blocks.get(id(plan))
        if block is None or block[0] is not plan:
            if len(self._blocks) >= BLOCK_CACHE:
                del self._blocks[next(iter(self._blocks))]
            n, k = plan.n_nodes, plan.k
            if k == 0:  # (lookup trees, a new one most steps: no mask slots to lay out)
                ids = np.zeros(plan.bc, dtype=np.int64)
            else:
                slots = np.tile(self.backend.vocab_size + np.arange(k), n)
                extra = np.zeros(plan.bc - n * (k + 1), dtype=np.int64)
                ids = np.concatenate([np.zeros(n, dtype=np.int64), slots, extra])
            block = (plan, n, ids, np.empty(plan.bc, dtype=np.int64),
                     n + np.arange(n * k, dtype=np.int64).reshape(n, k))
            block[4].flags.writeable = False  # drafters get views of it
            self._blocks[id(plan)] = block
        _, n, ids, positions, mask_rows = block
        if len(tokens) == n:
            ids[:n] = tokens
        else:  # rows after the nodes' masks (a lookahead window) come with the node tokens
            ids[:n] = tokens[:n]
            ids[n * (plan.k + 1):] = tokens[n:]
        np.add(plan.positions, p, out=positions)
        return ids, positions, mask_rows


def _copy_rows(out):
    """A prefill chunk's per-row outputs, copied out of the backend's reused buffers."""
    return StepOut(argmax=np.array(out.argmax), topk_ids=np.array(out.topk_ids),
                   topk_logprobs=np.array(out.topk_logprobs),
                   hidden=None if out.hidden is None else np.array(out.hidden))


def _join_rows(outs):
    """The per-row outputs of a chunked prefill as one block's (logits stay the last
    chunk's: only its rows are read from them)."""
    last = outs[-1]
    return StepOut(argmax=np.concatenate([o.argmax for o in outs]),
                   topk_ids=np.concatenate([o.topk_ids for o in outs]),
                   topk_logprobs=np.concatenate([o.topk_logprobs for o in outs]),
                   logits=last.logits,
                   hidden=None if last.hidden is None
                   else np.concatenate([o.hidden for o in outs]))
