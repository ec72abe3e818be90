"""Structured output: grammars compiled from a request's Constraint, a matcher per completion, and the bitmask of the
tokens each matcher allows now, which the sampler applies (replica/sampler.py, before penalties and top-k/top-p).

The library is xgrammar. Measured on SmolLM2's 49152-token vocabulary on 2 cores (64 different JSON schemas, 64
sequences): about 2 ms to compile a schema, and 2.4 ms per step to fill the 64 masks and accept the 64 tokens;
llguidance 1.9 compiles lazily (0.9 ms) but took 7.5 ms per step for the same masks (8.9 ms with its 2-thread
executor). The mask is on the step's path and compilation is not (see below), so the per-step cost decides.

Compilation runs on a worker thread of its own, never the engine's: the replica's handler awaits
`compile(constraint)` before it queues the request (and an invalid schema is its INVALID_ARGUMENT), so the request
waits for its grammar, never a step. Compiled grammars are cached by constraint, so a repeated schema compiles once.

A matcher's state is a function of the tokens it accepted, and tokens are accepted only when the engine emits them:
a preempted sequence keeps its matcher (recomputing KV changes no token), and a resumed stream's matcher accepts the
delivered tokens again (`matcher(grammar, tokens)`), so it stands where the failed replica's stood."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .request import Constraint

MAX_CACHED_GRAMMARS = 512  # a compiled JSON schema grammar is tens of KiB to a few MiB


class ConstraintError(ValueError):
    """A constraint that does not compile (a bad schema, regex or grammar): the request's INVALID_ARGUMENT."""


class Matcher:
    """Where one completion stands in its grammar."""

    def __init__(self, grammar) -> None:
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(grammar)

    def accept(self, token: int) -> bool:
        """Advances past a token the grammar allows; False (and no change) for one it does not."""
        return self._m.accept_token(token)

    @property
    def done(self) -> bool:
        """The grammar's text is complete and its end (an EOS token) accepted: nothing more may follow."""
        return self._m.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)


class Constraints:
    """Compiles constraints for one tokenizer and vocabulary, off the engine thread, and fills the masks of a step.
    Thread-safe: handlers call compile() while the engine thread calls masks()."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._compiler = None  # built on the worker by the first compile: tokenizer info takes about half a second
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[Constraint, Future] = OrderedDict()
        self._bitmask: torch.Tensor | None = None

    def compile(self, constraint: Constraint) -> Future:
        """The grammar of a constraint, as a future: cached, else compiled on the worker thread. Its exception is a
        ConstraintError naming what is wrong."""
        with self._lock:
            future = self._cache.get(constraint)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(constraint)
                return future
            future = self._pool.submit(self._compile, constraint)
            self._cache[constraint] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return future

    def grammar(self, constraint: Constraint):
        """The compiled grammar, waiting for it when a caller did not compile it first (the offline pipeline)."""
        return self.compile(constraint).result()

    def matcher(self, grammar, tokens: Iterable[int] = ()) -> Matcher:
        """A matcher at the grammar's start, advanced past `tokens` (a resumed stream's delivered output)."""
        m = Matcher(grammar)
        for t in tokens:
            if not m.accept(t):
                raise ValueError(f"resumed token {t} does not match the request's constraint")
        return m

    def masks(self, matchers: Sequence[Matcher | None]) -> list[torch.Tensor | None]:
        """Each matcher's allowed tokens now, as a row of one packed bitmask (None where unconstrained)."""
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < len(matchers):
            self._bitmask = xgr.allocate_token_bitmask(max(len(matchers), 64), self._vocab_size)
        out: list[torch.Tensor | None] = []
        for i, m in enumerate(matchers):
            if m is None:
                out.append(None)
            else:
                m.fill(self._bitmask, i)
                out.append(self._bitmask[i])
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- on the worker thread -----------------------------------------------------------------------------------
    def _compile(self, c: Constraint):
        compiler = self._get_compiler()
        try:
            if c.kind == "json_object":
                # Any object, in compact JSON: the builtin JSON grammar allows whitespace anywhere, which a small
                # model fills to max_tokens (the schemas below are compact too).
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if c.kind == "choice":
                # A regex of the escaped alternatives: xgrammar has no choice grammar of its own.
                return compiler.compile_grammar(choice_grammar(c.value))
            text = c.value
            assert isinstance(text, str), "only a choice constraint's value is a tuple (Constraint)"
            if c.kind == "json_schema":
                return compiler.compile_json_schema(text, any_whitespace=False)
            if c.kind == "regex":
                return compiler.compile_regex(text)
            return compiler.compile_grammar(text)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and others for bad input
            raise ConstraintError(f"constraint {c.kind} does not compile: {str(e)[:300]}") from None

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                _hf_tokenizer(self._tokenizer), vocab_size=self._vocab_size, stop_token_ids=self._eos
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly the choices (JSON string literals are valid GBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _hf_tokenizer(tokenizer):
    """The transformers tokenizer inside the engine's (a borrowed one wraps it)."""
    from .weights import BorrowedTokenizer

    return tokenizer.tokenizer if isinstance(tokenizer, BorrowedTokenizer) else tokenizer
