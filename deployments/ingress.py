"""``OpenAIIngress``: the OpenAI-compatible HTTP front (FastAPI on Ray Serve).

    POST /v1/completions, /v1/chat/completions   (JSON, or SSE with stream=true)
    GET  /v1/models, /health (200 / 503), /metrics (Prometheus text)

A request: auth, size limit, parse and validate (400s), ask the planner where to run it,
call that engine's ``generate`` as a stream; its first item says admitted (or why not: 400,
429), then outputs are relayed as they come. Every wait on another deployment has a
timeout, so a dead or stuck engine gives 503 (or an SSE error event), never a hang. A client
that goes away cancels the engine call, and the engine aborts the request.
"""

import asyncio
import hmac
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from spin_cluster.deployments.choices import Choice
from spin_cluster.deployments.errors import ApiError, install_handlers, logger
from spin_cluster.deployments.messages import Admitted, Failed, GenerateRequest
from spin_cluster.deployments.metrics import CONTENT_TYPE, RequestMetrics, ServingMetrics
from spin_cluster.deployments.openai_format import ChatFormat, CompletionFormat, new_id, sse, usage
from spin_cluster.deployments.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_body
from spin_cluster.deployments.settings import API_KEY_ENV, AppConfig

# No `from __future__ import annotations` here: Serve rebuilds the route methods, and FastAPI
# must see real classes (Request) in their signatures, not strings.
api = FastAPI(title="spin-cluster", docs_url=None, redoc_url=None, openapi_url=None)
install_handlers(api)

# Helpers sit above the deployment class: Serve serializes the class when it is decorated,
# with the module globals defined by then.

# Planner demand estimate when the prompt is text: about four characters per token.
_CHARS_PER_TOKEN = 4


def _client_gone(request_id: str, num_tokens: int, timeline: RequestMetrics) -> None:
    """A client that hangs up is an expected event: counted (finished_reason "abort") and
    logged in one line; the engine call is cancelled by the caller, which aborts the request."""
    timeline.finished("abort")
    logger.info("client disconnected: request %s aborted after %d tokens", request_id, num_tokens)


async def _read_body(request: Request, limit_bytes: int) -> bytes:
    too_big = ApiError(413, f"the request body is larger than {limit_bytes} bytes", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit_bytes:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


@serve.deployment(name="OpenAIIngress")
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, config: AppConfig, planner: DeploymentHandle, engine: DeploymentHandle) -> None:
        self._opts = config.serve
        self.model_name = config.model_name
        self._max_model_len = config.spin.model.max_model_len
        self._planner = planner
        self._engine = engine.options(stream=True)
        self._metrics = ServingMetrics(self.model_name)
        self._api_key = os.environ.get(API_KEY_ENV) or None
        self._created = int(time.time())
        # A drain (SIGTERM to `spin-cluster serve`): new requests get 503, /health turns 503,
        # and local mode waits until no request is in flight (counted to the end of its body).
        self._draining = False
        self._in_flight = 0

    # ---- drain (local mode's SIGTERM) -----------------------------------------------------

    def drain(self) -> int:
        """From now on new requests get 503; returns how many are in flight."""
        self._draining = True
        return self._in_flight

    def num_in_flight(self) -> int:
        return self._in_flight

    # ---- service endpoints --------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> JSONResponse:
        if self._draining:
            return JSONResponse({"status": "draining", "engines": 0}, status_code=503)
        try:
            num_ready = await self._call(self._planner.num_ready.remote())
        except ApiError:
            num_ready = 0
        return JSONResponse({"status": "ok" if num_ready else "unavailable", "engines": num_ready},
                            status_code=200 if num_ready else 503)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        try:
            stats = await self._call(self._planner.cluster_stats.remote())
        except ApiError:
            stats = None  # the planner is unreachable: keep the last engine stats
        return Response(self._metrics.render(stats), media_type=CONTENT_TYPE)

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        card = {"id": self.model_name, "object": "model", "created": self._created,
                "owned_by": "spin-cluster", "max_model_len": self._max_model_len}
        return {"object": "list", "data": [card]}

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._openai(request, CompletionRequest, CompletionFormat)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._openai(request, ChatCompletionRequest, ChatFormat)

    # ---- one OpenAI request -------------------------------------------------------------

    async def _openai(self, request: Request, model: type, fmt_cls: type[CompletionFormat]) -> Response:
        if self._draining:
            raise ApiError(503, "the server is shutting down; retry on another", code="shutting_down")
        self._in_flight += 1
        streaming = False
        try:
            response = await self._respond(request, model, fmt_cls)
            streaming = isinstance(response, StreamingResponse)  # counted down by _counted
            return response
        finally:
            if not streaming:
                self._in_flight -= 1

    async def _counted(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """A stream's events; the request is in flight until the last one is written or the
        client goes."""
        try:
            async for event in events:
                yield event
        finally:
            self._in_flight -= 1

    async def _respond(self, request: Request, model: type, fmt_cls: type[CompletionFormat]) -> Response:
        self._authorize(request)
        body = parse_body(await _read_body(request, self._opts.max_body_bytes), model)
        if body.model != self.model_name:
            raise ApiError(400, f"model {body.model!r} is not served here; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")
        request_id = new_id(fmt_cls.prefix)
        timeline = self._metrics.request()
        gen = body.to_generate(request_id)
        stream, admitted = await self._start(gen, timeline)
        fmt = fmt_cls(request_id, self.model_name, echo=admitted.prompt_text, logprobs=bool(body.logprobs))
        tools = None  # (mode, named function, every tool's name) of a chat request with tools
        if getattr(body, "tools", None):
            tools = (*body.tool_mode(), tuple(t.function.name for t in body.tools))
        choices = [Choice(i, tools) for i in range(gen.n)]
        if body.stream:
            events = self._sse(stream, admitted, fmt, choices, body.include_usage, body.continuous_usage, timeline)
            return StreamingResponse(self._counted(events), media_type="text/event-stream")
        return JSONResponse(await self._collect(stream, admitted, fmt, choices, timeline))

    async def _start(self, gen: GenerateRequest,
                     timeline: RequestMetrics) -> tuple[DeploymentResponseGenerator, Admitted]:
        try:
            target = await self._call(self._planner.route.remote(self._demand_tokens(gen)))
        except ApiError:
            target = None  # no planner: Serve's own routing still reaches an engine
        stream = self._engine.generate.remote(gen, route_to=target)
        try:
            first = await self._next(stream, self._opts.handle_timeout_s)
        except BaseException as e:
            stream.cancel()
            if isinstance(e, asyncio.CancelledError):
                _client_gone(gen.request_id, 0, timeline)
            raise
        if isinstance(first, Failed):
            raise ApiError(first.status, first.message, param=first.param, code=first.code)
        timeline.admitted(first.num_prompt_tokens)
        return stream, first

    async def _collect(self, stream: DeploymentResponseGenerator, admitted: Admitted, fmt: CompletionFormat,
                       choices: list[Choice], timeline: RequestMetrics) -> dict[str, Any]:
        num_tokens, done = 0, False
        try:
            while not done:
                item = await self._next_output(stream)
                choices[item.index].add(item)
                num_tokens += len(item.token_ids)
                timeline.tokens(len(item.token_ids))
                done = all(c.reason is not None for c in choices)
        except asyncio.CancelledError:
            _client_gone(fmt.id, num_tokens, timeline)
            raise
        finally:
            if not done:
                stream.cancel()
        timeline.finished(choices[0].reason)
        return fmt.response(choices, usage(admitted.num_prompt_tokens, num_tokens))

    async def _sse(self, stream: DeploymentResponseGenerator, admitted: Admitted, fmt: CompletionFormat,
                   choices: list[Choice], include_usage: bool, continuous_usage: bool,
                   timeline: RequestMetrics) -> AsyncIterator[str]:
        num_tokens, done = 0, False

        def so_far() -> dict[str, int] | None:  # a chunk's usage under continuous_usage_stats
            return usage(admitted.num_prompt_tokens, num_tokens) if continuous_usage else None

        try:
            for chunk in fmt.start_chunks(len(choices), include_usage, so_far()):
                yield sse(chunk)
            while not done:
                item = await self._next_output(stream)
                choice = choices[item.index]
                choice.add(item)
                num_tokens += len(item.token_ids)
                timeline.tokens(len(item.token_ids))
                for chunk in fmt.chunks(choice, item, include_usage, so_far()):
                    yield sse(chunk)
                done = all(c.reason is not None for c in choices)
            timeline.finished(choices[0].reason)
            if include_usage:
                yield sse(fmt.usage_chunk(usage(admitted.num_prompt_tokens, num_tokens)))
        except ApiError as e:  # headers are sent: the error goes in the stream
            yield sse(e.body())
        except (asyncio.CancelledError, GeneratorExit):
            _client_gone(fmt.id, num_tokens, timeline)
            raise
        finally:
            if not done:
                stream.cancel()
        yield sse("[DONE]")

    # ---- helpers ------------------------------------------------------------------------

    async def _next_output(self, stream: DeploymentResponseGenerator):
        item = await self._next(stream, self._opts.token_timeout_s)
        if isinstance(item, Failed):
            raise ApiError(item.status, item.message, param=item.param, code=item.code)
        return item

    async def _next(self, stream: DeploymentResponseGenerator, timeout_s: float) -> object:
        try:
            return await asyncio.wait_for(stream.__anext__(), timeout_s)
        except StopAsyncIteration:
            raise ApiError(503, "the engine closed the stream early", code="engine_unavailable") from None
        except asyncio.TimeoutError:
            raise ApiError(503, f"no output from the engine within {timeout_s:g}s", code="timeout") from None
        except Exception as e:  # the replica died, or Serve could not reach it
            raise ApiError(503, f"the engine is unavailable ({type(e).__name__}); retry",
                           code="engine_unavailable") from None

    async def _call(self, response: Any) -> Any:
        try:
            return await asyncio.wait_for(response, self._opts.handle_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(503, "the planner did not answer in time", code="timeout") from None
        except Exception as e:
            raise ApiError(503, f"the planner is unavailable ({type(e).__name__})",
                           code="planner_unavailable") from None

    def _authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._api_key.encode()):
            raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def _demand_tokens(self, gen: GenerateRequest) -> int:
        """Prompt plus output tokens, roughly, per choice: what the planner reserves on the engine."""
        if gen.prompt_token_ids is not None:
            prompt = len(gen.prompt_token_ids)
        else:
            text = gen.prompt or "".join(str(m.get("content", "")) for m in gen.messages or ())
            prompt = len(text) // _CHARS_PER_TOKEN + 1
        limit = self._max_model_len or 1 << 20
        return gen.n * min(limit, prompt + int(gen.sampling.get("max_tokens", 0)))

