"""One thread that owns an ``Engine``; everything else talks to it through commands.

The engine is not thread-safe, so only this thread calls it. Other threads (the replica's
event loop) push commands; the thread runs them between steps and hands each request's
outputs to that request's sink::

    submit / abort / call ──deque──▶ [loop thread: run commands, step(), dispatch] ──sink(item)──▶

A sink is called on the loop thread and must not block (the engine server's sinks post to an
asyncio queue with ``call_soon_threadsafe``). Items: ``Admitted`` or ``Failed`` first, then
``Delta`` until one is finished; an aborted request gets nothing more.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from spin_cluster.deployments.messages import Admitted, Delta, Failed, TokenLogprob

logger = logging.getLogger(__name__)

T = TypeVar("T")
Sink = Callable[[object], None]


class EngineLoop:
    def __init__(self, engine: Any, idle_wait_s: float = 0.5) -> None:
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()
        self._num_pending_adds = 0
        # Published by the loop thread after every step; read from any thread.
        self.num_waiting = 0
        self.num_running = 0
        self.num_admitted_total = 0
        # Set when a step raised: the engine's state is suspect (the server then reports
        # itself unhealthy, and Serve replaces the replica).
        self.failure: str | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._after_step: list[Callable[[Any], None]] = []
        self._token_text: dict[int, str] = {}  # token id -> its text, for logprobs (at most V)

    # ---- any thread ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def on_step(self, fn: Callable[[Any], None]) -> None:
        """Run ``fn(engine)`` on the loop thread after every step, and before every idle wait."""
        self._after_step.append(fn)

    def num_queued(self) -> int:
        """Requests not yet running: submitted but not added, plus the scheduler's waiting."""
        with self._lock:
            return self._num_pending_adds + self.num_waiting

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request_id: str, prompt: Any, params: Any, sink: Sink, prefill_after: str | None = None) -> None:
        """``prompt``: token ids, or an object whose ``token_ids(engine)`` makes them on this
        thread (the tokenizer is the engine's, and not safe to share between threads), and whose
        ``text(engine, ids)``, when it has one, is the prompt text ``Admitted`` carries.
        ``prefill_after``: ``Engine.add_request``'s (a request with the same prompt)."""
        with self._lock:
            self._num_pending_adds += 1
        self._push(lambda: self._add(request_id, prompt, params, sink, prefill_after))

    def abort(self, request_id: str) -> None:
        """Stop the request and free its pages; its sink gets nothing more."""
        self._push(lambda: self._abort(request_id))

    def fail_all(self, failed: Failed) -> None:
        """Every request in the engine gets ``failed`` as its last item and is aborted."""

        def fail() -> None:
            for request_id, sink in list(self._sinks.items()):
                _deliver(sink, failed)
                self._abort(request_id)

        self._push(fail)

    def call(self, fn: Callable[[Any], T]) -> Future[T]:
        """Run ``fn(engine)`` on the loop thread between steps."""
        fut: Future[T] = Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # handed to the caller, not lost in the thread
                    fut.set_exception(e)

        self._push(run)
        return fut

    def _push(self, command: Callable[[], None]) -> None:
        if self._stopping.is_set():
            raise RuntimeError("the engine loop has stopped")
        self._commands.append(command)
        self._wake.set()

    # ---- loop thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            self._run_commands()
            if self.engine.has_unfinished():
                self._step()
                self._publish_counts()
                self._run_hooks()
            else:  # hooks first: they see what the commands (an abort, say) left, before the wait
                self._run_hooks()
                self._wake.wait(self._idle_wait_s)
        self._run_commands()
        for request_id in list(self._sinks):
            self._abort(request_id)

    def _run_commands(self) -> None:
        ran = False
        while self._commands:
            ran = True
            try:
                self._commands.popleft()()
            except Exception:
                logger.exception("engine loop command failed")
        if ran:  # adds and aborts change the queue: admission control reads these at once
            self._publish_counts()

    def _add(self, request_id: str, prompt: Any, params: Any, sink: Sink, prefill_after: str | None) -> None:
        try:
            self._admit(request_id, prompt, params, sink, prefill_after)
        finally:  # counted as waiting before it stops counting as pending: never undercounted
            self._publish_counts()
            with self._lock:
                self._num_pending_adds -= 1

    def _admit(self, request_id: str, prompt: Any, params: Any, sink: Sink, prefill_after: str | None) -> None:
        try:
            ids = prompt.token_ids(self.engine) if hasattr(prompt, "token_ids") else [int(t) for t in prompt]
        except Exception as e:  # a chat template that rejects the messages, a bad token id
            _deliver(sink, Failed(400, f"could not tokenize the prompt: {e}", param="prompt", code="invalid_prompt"))
            return
        try:
            self.engine.add_request(ids, params, request_id=request_id, prefill_after=prefill_after)
        except ValueError as e:  # prompt too long, empty, out of vocabulary, id in use; logit_bias ids
            param = next((name for name in _PARAMS_NAMED_BY_THE_ENGINE if str(e).startswith(name)), "prompt")
            _deliver(sink, Failed(400, str(e), param=param, code="invalid_prompt" if param == "prompt" else "invalid_value"))
            return
        self._sinks[request_id] = sink
        self.num_admitted_total += 1
        text = prompt.text(self.engine, ids) if hasattr(prompt, "text") else None
        if not _deliver(sink, Admitted(len(ids), text)):
            self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self.engine.abort(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; failing its requests")
            self.failure = f"{type(e).__name__}: {e}"
            for request_id, sink in list(self._sinks.items()):
                _deliver(sink, Failed(500, f"the engine failed: {e}", code="engine_error"))
                self._abort(request_id)
            return
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            delta = Delta(out.new_text, tuple(out.new_token_ids), out.finished, out.finish_reason,
                          logprobs=self._texts(out.new_logprobs), prompt_logprobs=self._prompt_logprobs(out))
            if not _deliver(sink, delta) and not out.finished:
                self._abort(out.request_id)

    def _prompt_logprobs(self, out: Any) -> tuple[TokenLogprob, ...] | None:
        """The prompt's logprobs, in a request's first output only; its first token, which
        nothing scores, with a logprob of None."""
        if out.prompt_logprobs is None or len(out.token_ids) != len(out.new_token_ids):
            return None
        return (TokenLogprob(self._text(out.prompt_token_ids[0]), None), *self._texts(out.prompt_logprobs))

    def _texts(self, logprobs: list[Any]) -> tuple[TokenLogprob, ...]:
        """The engine's ``TokenLogprobs`` with each token as its own text (special tokens
        too: a logprob belongs to a token whatever it is)."""
        text = self._text
        return tuple(TokenLogprob(text(lp.token_id), lp.logprob, tuple((text(t), v) for t, v in lp.top))
                     for lp in logprobs)

    def _text(self, token_id: int) -> str:
        found = self._token_text.get(token_id)
        if found is None:
            found = self._token_text[token_id] = self.engine.tokenizer.hf_tokenizer.decode([token_id])
        return found

    def _publish_counts(self) -> None:
        self.num_waiting = self.engine.scheduler.num_waiting()
        self.num_running = self.engine.scheduler.num_running()

    def _run_hooks(self) -> None:
        for fn in self._after_step:
            try:
                fn(self.engine)
            except Exception:
                logger.exception("engine loop step hook failed")


# add_request's errors that are about a sampling field, not the prompt, start with its name.
_PARAMS_NAMED_BY_THE_ENGINE = ("logit_bias", "response_format", "tools")


def _deliver(sink: Sink, item: object) -> bool:
    try:
        sink(item)
        return True
    except Exception:  # the receiving event loop is gone: the request has no reader
        logger.warning("dropping output for a request whose reader is gone", exc_info=True)
        return False
