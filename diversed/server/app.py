"""`diversed serve`: an OpenAI-compatible HTTP server over one loaded pair (FastAPI on uvicorn).

POST /v1/completions and /v1/chat/completions (streamed as server-sent events with `stream: true`), each
request with its own verification rule, weight and head (diversed.server.protocol); GET /v1/models,
/v1/verification (what a request's dial may be set to), /health and /metrics (Prometheus); GET / is the
playground, a page that shows how each token was made (static files in ./playground). Requests join one
continuously batched decoding loop (diversed.server.worker); a client that goes away frees its row at the next
round.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from diversed.admission import admit, load_head
from diversed.decoding.drafters import SuffixCache, make_drafter, prediction_tokens
from diversed.decoding.engine import Batch, Job
from diversed.decoding.policy import Head
from diversed.decoding.provenance import TokenOrigin, records
from diversed.decoding.schedule import CostMemory
from diversed.head.names import PRETRAINED_HEADS
from diversed.models.default_pair import costs_file
from diversed.models.loading import Pair
from diversed.request import (
    DEFAULT_DRAFTING,
    DRAFTERS,
    RULE_SPECS,
    ContextTooLong,
    Drafting,
    HeadNotFound,
    RequestError,
    RuleSpec,
    Verification,
    renamed_keywords,
)
from diversed.server.metrics import Metrics
from diversed.server.protocol import (
    FINISH_REASONS,
    BadRequest,
    Call,
    Reply,
    error_body,
    parse_call,
    request_error,
    usage,
)
from diversed.server.worker import QueueFull, Worker
from diversed.text import StreamedText, TokenTexts

_PAGE = Path(__file__).parent / "playground"  # the playground's static files, shipped in the package


@renamed_keywords(method="verification", draft_length="drafting")
@dataclass
class ServerConfig:
    """What a server runs. verification: the rule of requests that name none; heads: name -> head folder (the
    heads shipped for the built-in pair are added under their names, and the default one as "default", when
    they fit the pair); max_batch: requests decoded together; max_waiting: requests queued beyond them (more get
    503); max_tokens: a chat request's limit when it sets none (None: what the context leaves, as OpenAI and
    llama-server do); drafting: the batch's (None: the backend's default); drafter: what drafts
    for requests that name none (diversed.decoding.drafters; the batch holds them all, and one suffix cache
    over every request's text)."""

    verification: str = "exact"
    heads: dict[str, str] = field(default_factory=dict)
    max_batch: int = 8
    max_waiting: int = 64
    max_tokens: int | None = None
    drafting: Drafting | None = None
    model_name: str | None = None
    drafter: str = "auto"

    def __post_init__(self) -> None:
        for name, low in (("max_batch", 1), ("max_waiting", 0), ("max_tokens", 1)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if self.model_name is not None and not self.model_name.strip():
            raise ValueError("model_name must not be empty (leave it out for the target's name)")
        verification = Verification.parse(self.verification)
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if self.drafter == "prediction":
            raise ValueError("drafter 'prediction' as the server's default would refuse every request without a "
                             "prediction: 'auto' drafts from a request's prediction first (a request may still "
                             "name 'prediction')")
        if verification.name == "diversed" and verification.head not in (None, "default", *self.heads,
                                                                          *PRETRAINED_HEADS):
            raise ValueError(f"--verification {self.verification}: no head named {verification.head!r} (the server "
                             "holds the heads given with --head NAME=DIR and the shipped ones: "
                             f"{', '.join(PRETRAINED_HEADS)})")


class Server:
    """The pair, its heads, the engine thread and the metrics behind the routes. costs: the speed schedule's
    measured costs (default: the cache folder's file, saved when the engine stops)."""

    def __init__(self, pair: Pair, config: ServerConfig, costs: CostMemory | None = None) -> None:
        self.pair, self.config = pair, config
        self.model_name = config.model_name or pair.target_name
        self.default_verification = Verification.parse(config.verification)
        self.heads: dict[str, Head] = {name: load_head(pair, folder) for name, folder in config.heads.items()}
        for name in ("default", *PRETRAINED_HEADS):
            if name not in self.heads:
                try:
                    self.heads[name] = load_head(pair, None if name == "default" else name)
                except ValueError:  # the shipped heads fit the built-in pair only
                    pass
        default = self.default_verification
        if default.name == "diversed" and default.head not in (None, *self.heads):
            raise ValueError(f"--verification {config.verification}: no head named {default.head!r} is loaded (the "
                             "shipped heads fit the built-in pair only: give one with --head NAME=DIR)")
        if default.name == "diversed" and not self.heads:
            raise ValueError(f"--verification {config.verification}: no head fits this pair (the shipped heads fit "
                             "the built-in pair only): give one with --head NAME=DIR")
        self.drafting = config.drafting or DEFAULT_DRAFTING[pair.backend]
        self.costs = CostMemory(costs_file()) if costs is None else costs
        self.metrics = Metrics()
        self.cache = SuffixCache()  # shared by every batch and request of this server
        self.worker = Worker(self._new_batch, config.max_waiting, self._gauges, self.costs.save)

    def _new_batch(self) -> Batch:
        drafter = make_drafter("auto", self.pair.draft, capacity=self.config.max_batch,
                               confidence=self.drafting.confidence, cache=self.cache)
        return Batch(self.pair.target, drafter, drafting=self.drafting, eos_token_ids=self.pair.eos_token_ids,
                     capacity=self.config.max_batch, costs=self.costs)

    def _gauges(self, running: int, waiting: int) -> None:
        self.metrics.running.set(running)
        self.metrics.waiting.set(waiting)

    def call(self, body, chat: bool) -> Call:
        """A body as a Call, with the server's rule, drafting and drafter for what it leaves out; BadRequest for
        what the wire format or the request refuses."""
        try:
            return parse_call(body, chat, self.default_verification, self.drafting, self.config.drafter)
        except RequestError as error:
            raise BadRequest(*request_error(error, chat)) from None

    def job(self, call: Call) -> Job:
        """The decoding job of a call (diversed.admission.admit); BadRequest for what only the pair can tell
        (an unknown head, a prompt too long for the context, no draft model)."""
        try:
            # A "diversed" that names no head gets the default one (or the first loaded).
            heads = {**self.heads, None: self.heads.get("default", next(iter(self.heads.values()), None))}
            job, = admit(call.request, self.pair, heads)
        except HeadNotFound as error:
            raise BadRequest(error.message_for("head"), call.head_field, "head_not_found") from None
        except RequestError as error:
            code = "context_length_exceeded" if isinstance(error, ContextTooLong) else None
            raise BadRequest(*request_error(error, call.chat), code) from None
        if not call.max_tokens_set and self.config.max_tokens is not None:  # the server's limit, within the room
            job.max_new_tokens = min(job.max_new_tokens, self.config.max_tokens)
        return job


class _Events:
    """A job's progress as the event loop sees it: the engine thread's callbacks become queue items
    (a round's new tokens and their origins, and whether the job is finished; or an error)."""

    def __init__(self, server: Server, job: Job, arrived: float) -> None:
        self.server, self.job, self.arrived, self.last = server, job, arrived, None
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        job.on_tokens = self._on_tokens

    def _on_tokens(self, job: Job, new: list[int]) -> None:  # the engine thread
        if job.stats.finish_reason == "error":
            self.fail(job, f"decoding failed: {job.error}")
            return
        now, metrics = time.perf_counter(), self.server.metrics
        if new:
            metrics.generation_tokens.inc(len(new))
            if self.last is None:
                metrics.time_to_first_token.observe(now - self.arrived)
            else:
                for _ in new:
                    metrics.inter_token_latency.observe((now - self.last) / len(new))
            self.last = now
        if job.finished:
            stats = job.stats
            metrics.requests.labels(stats.finish_reason).inc()
            if job.cache_prompt:  # as vLLM counts them: prompt tokens looked up, and found
                metrics.prefix_cache_queries.inc(len(job.prompt))
                metrics.prefix_cache_hits.inc(stats.cached_tokens)
            metrics.e2e_latency.observe(now - self.arrived)
            if job.policy.drafts:
                metrics.record_rounds(job.policy.verification, stats.drafted, stats.accepted,
                                      stats.reached[0] if stats.reached else 0, stats.kept, stats.drafters)
        # The round's tokens only (the engine never waits on a copy), with their origins as they are now.
        origins = job.origins[len(job.tokens) - len(new):] if job.provenance else []
        self._put(("tokens", (new, origins), job.finished))

    def fail(self, job: Job, message: str) -> None:  # the engine thread
        self.server.metrics.errors.labels("500").inc()
        self._put(("error", message, True))

    def _put(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone: nobody is listening
            pass

    async def __aiter__(self) -> AsyncIterator[tuple]:
        while True:
            item = await self.queue.get()
            yield item
            if item[2]:
                return


def create_app(pair: Pair, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving `pair`; the engine thread starts and stops with the app (its lifespan):
    on shutdown (SIGTERM under uvicorn) running and queued requests finish first."""
    server = Server(pair, config or ServerConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.worker.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, server.worker.stop)

    app = FastAPI(title="diversed", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(BadRequest)
    async def refused(request: Request, error: BadRequest) -> JSONResponse:
        server.metrics.errors.labels(str(error.status)).inc()
        headers = {"Retry-After": "1"} if error.status == 503 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def unrouted(request: Request, error: HTTPException) -> JSONResponse:  # no such path, or method
        server.metrics.errors.labels(str(error.status_code)).inc()
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {error.detail}", "invalid_request_error"),
                            status_code=error.status_code, headers=error.headers)

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(_PAGE / "index.html")

    app.mount("/static", StaticFiles(directory=_PAGE), name="static")

    @app.get("/v1/verification")
    async def verification() -> dict:
        return _dial(server)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = server.worker.alive
        return JSONResponse({"status": "ok" if ok else "engine stopped", "running": server.worker.running,
                             "waiting": server.worker.waiting}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "diversed", "heads": sorted(server.heads)}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(server, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _complete(server, request, chat=True)

    return app


async def _complete(server: Server, request: Request, chat: bool) -> Response:
    arrived = time.perf_counter()
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError) as error:  # RecursionError: nested deeper than the parser goes
        raise BadRequest(f"the request body is not valid JSON: {error}", None, "invalid_json") from None
    call = server.call(body, chat)
    if call.model is not None and call.model != server.model_name:
        raise BadRequest(f"the model {call.model!r} does not exist; this server has {server.model_name!r}", "model",
                         "model_not_found", status=404)
    job = await asyncio.to_thread(server.job, call)  # tokenizing a long prompt must not stall other connections
    events = _Events(server, job, arrived)
    try:
        server.worker.submit(job, events.fail)
    except QueueFull as error:
        raise BadRequest(f"the server is overloaded ({error}); retry later", None, "server_overloaded",
                         status=503) from None
    server.metrics.prompt_tokens.inc(len(job.prompt))
    reply = Reply(chat, server.model_name, call.include_usage)
    text = StreamedText(server.pair.tokenizer, call.request.stop)
    record = _recorder(server.pair.tokenizer) if call.request.provenance else None
    if call.stream:
        return StreamingResponse(_stream(server, job, events, reply, text, record, call),
                                 media_type="text/event-stream")
    return await _whole(server, request, job, events, reply, text, record)


Recorder = Callable[[list[int], list[TokenOrigin]], list[dict]]


def _recorder(tokenizer) -> Recorder:
    """A request's provenance records, round by round: each new token's text (TokenTexts) and origin."""
    texts = TokenTexts(tokenizer)
    return lambda new, origins: records(tokenizer, new, texts.add(new), origins)


def _dial(server: Server) -> dict:
    """What a request may set of its verification, for clients that build a dial (the playground): the
    server's rule, every rule with its parameters, their defaults and ranges, the loaded heads, the drafters
    (with whether this server can run each), and the server's drafting."""
    def parameter(spec: RuleSpec, name: str) -> dict:
        allowed = spec.range(name)
        return {"name": name, "default": spec.defaults.get(name), "min": allowed.low,
                "max": None if allowed.high == math.inf else allowed.high, "min_open": allowed.low_open,
                "max_open": allowed.high_open or allowed.high == math.inf, "range": allowed.text}

    rules = [{"name": "plain", "summary": "the target alone: no drafts", "parameters": []}]
    rules += [{"name": spec.name, "summary": spec.summary, "parameters": [parameter(spec, p) for p in spec.parameters]}
              for spec in RULE_SPECS.values() if spec.name != "dynamic"]  # "dynamic" needs a head: "diversed"
    if server.heads:
        rules.append({"name": "diversed", "summary": "a trained head sets each drafted token's weight or lenience",
                      "parameters": [], "heads": sorted(server.heads)})
    drafters = [{"name": name, "available": name != "model" or server.pair.draft is not None} for name in DRAFTERS]
    return {"default": server.default_verification.label, "rules": rules, "drafters": drafters,
            "default_drafter": server.config.drafter, "max_draft_length": server.drafting.longest}


def _speculative(job: Job) -> dict:
    stats = job.stats.to_dict()
    return {"verification": job.policy.verification.label,
            **{k: stats[k] for k in ("drafted", "accepted", "acceptance_rate", "tau", "tokens_per_s",
                                     "per_position_acceptance", "rule_tokens", "target_tokens", "drafters")}}


def _usage(job: Job) -> dict:
    return usage(len(job.prompt), len(job.tokens),
                 None if job.prediction is None else prediction_tokens(job.prediction, job.tokens),
                 job.stats.cached_tokens)


async def _whole(server: Server, request: Request, job: Job, events: _Events, reply: Reply,
                 text: StreamedText, record: Recorder | None) -> Response:
    """Wait for the job, watching for the client going away (then its row is freed)."""
    items = aiter(events)
    pending = asyncio.ensure_future(anext(items))
    checked, pieces, provenance = time.monotonic(), [], []
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=0.5)
            if time.monotonic() - checked >= 0.5:  # however often tokens come
                checked = time.monotonic()
                if await request.is_disconnected():
                    job.cancelled = True
                    server.worker.wake()
                    return Response(status_code=499)
            if not done:
                continue
            kind, payload, finished = pending.result()
            if kind == "error":
                return JSONResponse(error_body(payload, "server_error"), status_code=500)
            new, origins = payload
            pieces.append(text.add(new, final=finished))
            if record is not None:
                provenance += record(new, origins)
            if finished:
                body = reply.whole("".join(pieces), FINISH_REASONS[job.stats.finish_reason], _usage(job),
                                   _speculative(job), None if record is None else provenance)
                return JSONResponse(body)
            pending = asyncio.ensure_future(anext(items))
    finally:
        pending.cancel()


async def _stream(server: Server, job: Job, events: _Events, reply: Reply, text: StreamedText,
                  record: Recorder | None, call: Call) -> AsyncIterator[str]:
    """Server-sent events: a chunk per round's new text, the finish reason, usage if asked, [DONE]. A client
    that disconnects cancels the generator here, which cancels the job."""
    def sse(body: dict) -> str:
        return f"data: {json.dumps(body)}\n\n"

    try:
        first = True
        if reply.chat:  # the role comes first, as OpenAI sends it
            yield sse(reply.chunk(None, first=True))
            first = False
        async for kind, payload, finished in events:
            if kind == "error":
                yield sse(error_body(payload, "server_error"))
                break
            new, origins = payload
            piece = text.add(new, final=finished)
            provenance = None if record is None else record(new, origins)
            if piece or provenance:
                yield sse(reply.chunk(piece, first=first, provenance=provenance))
                first = False
            if finished:
                yield sse(reply.chunk(None if reply.chat else "", FINISH_REASONS[job.stats.finish_reason]))
                if call.include_usage:
                    yield sse(reply.usage_chunk(_usage(job), _speculative(job)))
        yield "data: [DONE]\n\n"
    finally:
        if not job.finished:
            job.cancelled = True
            server.worker.wake()


def check_address(host: str, port: int) -> None:
    """ValueError unless this machine can listen on host:port now: a port out of range, a host it cannot
    resolve, a port taken or not its to take, found before the models load rather than after."""
    if not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as error:
        raise ValueError(f"host {host!r} is not an address this machine can listen on ({error})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as error:
            raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}") from None


def serve(pair: Pair, config: ServerConfig | None = None, *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve `pair` until SIGINT or SIGTERM, which first lets running and queued requests finish."""
    import uvicorn

    check_address(host, port)
    app = create_app(pair, config)
    print(f"the playground: http://{host}:{port}/ (the API: http://{host}:{port}/v1)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="info")
