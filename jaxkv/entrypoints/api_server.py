"""``jaxkv serve``: an OpenAI-compatible HTTP server (FastAPI on uvicorn, as vLLM's).

One engine thread steps continuously; HTTP handlers hand it requests and aborts through a
thread-safe inbox and receive each sequence's text through an asyncio queue. Endpoints:
``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or not),
``/v1/models``, ``/health``, ``/metrics`` (Prometheus). A full server answers 503, a bad request
400 with OpenAI's error object; a client that disconnects aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from jaxkv.engine.request import SamplingParams
from jaxkv.entrypoints.llm import LLM
from jaxkv.entrypoints.output_processor import prompt_logprob_dicts

__all__ = ["EngineLoop", "build_app", "serve"]


class EngineLoop:
  """The engine's thread: admits, aborts and steps; streams each sequence's deltas to its queue.

  Events on a sequence's queue: ``("prompt_logprobs", entries)`` (first, when asked for),
  ``("delta", text, token_ids, logprobs)`` and, last, ``("done", finish_reason, stop_reason)`` or
  ``("error", message)``.
  """

  def __init__(self, llm: LLM, *, max_pending: int = 256):
    self.llm, self.max_pending = llm, max_pending
    self._inbox: queue.Queue = queue.Queue()
    self._wake = threading.Event()
    self._stop = threading.Event()
    self._streams: dict[str, tuple] = {}  # engine request id -> (state, asyncio queue, event loop)
    self._pending = 0  # admitted and unfinished prompts (the bound of the queue)
    self._lock = threading.Lock()
    self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "cached_tokens": 0, "requests": 0}
    self.ttft: list[float] = []  # seconds, appended once per sequence (read by /metrics)
    self._thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)
    self._thread.start()

  def submit(self, prompt, sampling: SamplingParams, loop: asyncio.AbstractEventLoop) -> tuple[str, list]:
    """Queues a prompt; returns its id and one asyncio queue per sequence. Raises OverflowError
    when ``max_pending`` prompts are unfinished, ValueError on a bad prompt (nothing admitted)."""
    with self._lock:
      if self._pending >= self.max_pending:
        raise OverflowError(
          f"the server has {self._pending} unfinished requests (--max-pending {self.max_pending}); retry later"
        )
      self._pending += 1
    request_id = f"cmpl-{uuid.uuid4().hex[:16]}"
    queues = [asyncio.Queue() for _ in range(sampling.n)]
    done = threading.Event()
    result: dict = {}
    self._inbox.put(("add", request_id, prompt, sampling, queues, loop, done, result))
    self._wake.set()
    done.wait()
    if "error" in result:
      with self._lock:
        self._pending -= 1
      raise result["error"]
    return request_id, queues, result["prompt_token_ids"]

  def abort(self, request_id: str, n: int) -> None:
    self._inbox.put(("abort", request_id, n))
    self._wake.set()

  def shutdown(self) -> None:
    self._stop.set()
    self._wake.set()
    self._thread.join(timeout=30)

  def _run(self) -> None:
    engine = self.llm.engine
    while not self._stop.is_set():
      self._drain()
      if not engine.has_unfinished():
        self._wake.wait(0.05)
        self._wake.clear()
        continue
      try:
        steps = engine.step()
      except Exception as e:  # the engine could not step: every stream ends with the error
        for rid in list(self._streams):
          self._finish(rid, ("error", f"{type(e).__name__}: {e}"))
        continue
      for step in steps:
        entry = self._streams.get(step.request_id)
        if entry is None:
          continue
        state, q, loop, t0 = entry
        if step.new_token_ids and not state.output.token_ids:
          self.ttft.append(time.perf_counter() - t0)
        first = not state.output.token_ids
        if step.prompt_logprobs is not None and state.output.index == 0:
          loop.call_soon_threadsafe(
            q.put_nowait,
            ("prompt_logprobs", _prompt_logprobs_json(prompt_logprob_dicts(step.prompt_logprobs, self.llm.tokenizer))),
          )
        before = len(state.output.logprobs or ())
        text, ids = state.add(step)
        self.stats["generation_tokens"] += len(ids)
        if first and ids and state.output.index == 0:  # the prompt's hits, once
          self.stats["cached_tokens"] += step.num_cached_tokens
        if text or ids:
          lps = None if state.output.logprobs is None else state.output.logprobs[before:]
          loop.call_soon_threadsafe(q.put_nowait, ("delta", text, ids, lps))
        if state.finished:
          if not step.finished:
            engine.abort(step.request_id)  # a stop string
          self._finish(step.request_id, ("done", state.output.finish_reason, state.output.stop_reason))

  def _drain(self) -> None:
    while True:
      try:
        item = self._inbox.get_nowait()
      except queue.Empty:
        return
      if item[0] == "add":
        _, request_id, prompt, sampling, queues, loop, done, result = item
        try:
          out, states = self.llm.add_request(prompt, sampling, request_id)
          t0 = time.perf_counter()
          for (rid, state), q in zip(states.items(), queues):
            self._streams[rid] = (state, q, loop, t0)
          result["prompt_token_ids"] = out.prompt_token_ids
          self.stats["prompt_tokens"] += len(out.prompt_token_ids)
          self.stats["requests"] += 1
        except Exception as e:
          result["error"] = e
        done.set()
      else:
        _, request_id, n = item
        for i in range(n):
          rid = f"{request_id}-{i}"
          if rid in self._streams:
            self.llm.engine.abort(rid)
            self._finish(rid, ("done", "abort", None))

  def _finish(self, rid: str, event: tuple) -> None:
    state, q, loop, _ = self._streams.pop(rid)
    loop.call_soon_threadsafe(q.put_nowait, event)
    if state.output.index == 0:  # one count per prompt
      with self._lock:
        self._pending -= 1


class _BadRequest(ValueError):
  def __init__(self, message: str, param: str | None = None):
    super().__init__(message)
    self.param = param


def _error(status: int, message: str, kind: str, param: str | None = None):
  return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


def _sampling(body: dict, *, chat: bool) -> SamplingParams:
  """OpenAI's request fields (and vLLM's extras: top_k, seed, stop_token_ids, prompt_logprobs) as
  SamplingParams.
  OpenAI's defaults: temperature 1, 16 tokens for completions, the model's room for chat."""

  def get(name, kind, default):
    value = body.get(name, default)
    if value is None:
      return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
      raise _BadRequest(f"'{name}' must be {kind.__name__}, got {value!r}", name)
    return value

  max_tokens = get("max_completion_tokens", int, None) if chat else None
  max_tokens = max_tokens or get("max_tokens", int, 16)
  if chat:
    logprobs = get("top_logprobs", int, 0) if get("logprobs", bool, False) else 0
  else:
    logprobs = get("logprobs", int, 0)
  stop = body.get("stop") or ()
  if isinstance(stop, str):
    stop = (stop,)
  if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
    raise _BadRequest(f"'stop' must be a string or a list of strings, got {stop!r}", "stop")
  try:
    return SamplingParams(
      max_tokens=max_tokens,
      temperature=get("temperature", float, 1.0),
      top_p=get("top_p", float, 1.0),
      top_k=get("top_k", int, 0),
      n=get("n", int, 1),
      seed=get("seed", int, None),
      stop=tuple(stop),
      stop_token_ids=tuple(get("stop_token_ids", list, [])),
      logprobs=logprobs,
      prompt_logprobs=get("prompt_logprobs", int, None),
    )
  except ValueError as e:
    raise _BadRequest(str(e)) from None


def build_app(llm: LLM, *, model_name: str | None = None, max_pending: int = 256):
  """The FastAPI application over ``llm``'s engine (its thread starts now; ``app.state.loop``)."""
  name = model_name or llm.model
  engine_loop = EngineLoop(llm, max_pending=max_pending)

  @contextlib.asynccontextmanager
  async def lifespan(_):
    yield
    engine_loop.shutdown()

  app = FastAPI(title="jaxkv", description="OpenAI-compatible server over jaxkv's engine", lifespan=lifespan)
  app.state.loop = engine_loop
  started = time.time()

  registry = CollectorRegistry()
  engine = llm.engine
  gauges = {
    "num_requests_running": ("requests on the engine's rows", lambda: len(engine.scheduler.running)),
    "num_requests_waiting": ("requests waiting for a row or blocks", lambda: len(engine.scheduler.waiting)),
    "kv_cache_usage_perc": (
      "fraction of KV-cache blocks in use",
      lambda: 1 - engine.kv.num_free_blocks / max(engine.plan.num_blocks, 1),
    ),
    "prefix_cache_hit_rate": (
      "prompt tokens found in the prefix cache / prompt tokens",
      lambda: engine_loop.stats["cached_tokens"] / max(engine_loop.stats["prompt_tokens"], 1),
    ),
    "prompt_tokens_total": ("prompt tokens admitted", lambda: engine_loop.stats["prompt_tokens"]),
    "generation_tokens_total": ("tokens generated", lambda: engine_loop.stats["generation_tokens"]),
    "generation_tokens_per_second": (
      "tokens generated per second since start",
      lambda: engine_loop.stats["generation_tokens"] / max(time.time() - started, 1e-9),
    ),
    "time_to_first_token_seconds_mean": (
      "mean seconds from admission to a sequence's first token",
      lambda: sum(engine_loop.ttft) / max(len(engine_loop.ttft), 1),
    ),
  }
  for metric, (doc, fn) in gauges.items():
    Gauge(f"jaxkv_{metric}", doc, registry=registry).set_function(fn)

  def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
      "prompt_tokens": prompt_tokens,
      "completion_tokens": completion_tokens,
      "total_tokens": prompt_tokens + completion_tokens,
    }

  async def body_of(request: Request) -> dict:
    try:
      body = await request.json()
    except ValueError:
      raise _BadRequest("the body is not JSON") from None
    if not isinstance(body, dict):
      raise _BadRequest("the body must be a JSON object")
    if body.get("model") not in (None, name):
      raise _BadRequest(f"model {body.get('model')!r} is not served here; this server serves {name!r}", "model")
    return body

  def tokenizer_needed(what: str):
    if llm.tokenizer is None:
      raise _BadRequest(f"{what} needs a tokenizer; {name} has no tokenizer.json (send token ids to /v1/completions)")

  @app.exception_handler(_BadRequest)
  async def bad_request(_, e: _BadRequest):
    return _error(400, str(e), "BadRequestError", e.param)

  @app.get("/health")
  async def health():
    return PlainTextResponse("ok")

  @app.get("/v1/models")
  async def models():
    return {
      "object": "list",
      "data": [
        {
          "id": name,
          "object": "model",
          "created": int(started),
          "owned_by": "jaxkv",
          "max_model_len": engine.config.max_model_len,
        }
      ],
    }

  @app.get("/metrics")
  async def metrics():
    return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

  async def run(request: Request, prompts: list, sampling: SamplingParams, stream: bool, chat: bool):
    loop = asyncio.get_running_loop()
    submitted = []
    try:
      for p in prompts:
        submitted.append(await loop.run_in_executor(None, engine_loop.submit, p, sampling, loop))
    except OverflowError as e:
      for rid, _, _ in submitted:
        engine_loop.abort(rid, sampling.n)
      return _error(503, str(e), "ServiceUnavailableError")
    except ValueError as e:
      for rid, _, _ in submitted:
        engine_loop.abort(rid, sampling.n)
      raise _BadRequest(str(e)) from None
    queues = [q for _, qs, _ in submitted for q in qs]
    ids = [rid for rid, _, _ in submitted]
    response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    prompt_tokens = sum(len(ptoks) for _, _, ptoks in submitted)
    body = request.state.body

    def abort_all():
      for rid in ids:
        engine_loop.abort(rid, sampling.n)

    if stream:

      async def events():
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i, q):
          while True:
            ev = await q.get()
            await merged.put((i, ev))
            if ev[0] in ("done", "error"):
              return

        tasks = [asyncio.create_task(pump(i, q)) for i, q in enumerate(queues)]
        open_, completion_tokens = len(queues), 0
        try:
          if chat:
            for i in range(len(queues)):
              yield _sse(_chunk(response_id, created, name, i, {"role": "assistant", "content": ""}, None, chat))
          while open_:
            i, ev = await merged.get()
            if ev[0] == "prompt_logprobs":
              chunk = _chunk(response_id, created, name, i, {} if chat else "", None, chat)
              chunk["choices"][0]["prompt_logprobs"] = ev[1]
              yield _sse(chunk)
            elif ev[0] == "delta":
              completion_tokens += len(ev[2])
              delta = {"content": ev[1]} if chat else ev[1]
              yield _sse(
                _chunk(response_id, created, name, i, delta, None, chat, _logprobs(ev, chat, llm, sampling.logprobs))
              )
            else:
              open_ -= 1
              reason = "error" if ev[0] == "error" else ev[1]
              yield _sse(_chunk(response_id, created, name, i, {} if chat else "", reason, chat))
          if body.get("stream_options", {}).get("include_usage"):
            yield _sse(
              {
                "id": response_id,
                "object": obj + ".chunk" if chat else obj,
                "created": created,
                "model": name,
                "choices": [],
                "usage": usage(prompt_tokens, completion_tokens),
              }
            )
          yield "data: [DONE]\n\n"
        finally:  # also when the client went away mid-stream
          for t in tasks:
            t.cancel()
          if open_:
            abort_all()

      return StreamingResponse(events(), media_type="text/event-stream")

    choices = [None] * len(queues)
    texts = [""] * len(queues)
    token_ids: list[list[int]] = [[] for _ in queues]
    lps: list[list] = [[] for _ in queues]
    prompt_lps: list = [None] * len(queues)
    try:
      for i, q in enumerate(queues):
        while True:
          try:
            ev = await asyncio.wait_for(q.get(), timeout=0.5)
          except asyncio.TimeoutError:
            if await request.is_disconnected():
              abort_all()
              return JSONResponse({}, status_code=499)
            continue
          if ev[0] == "prompt_logprobs":
            prompt_lps[i] = ev[1]
            continue
          if ev[0] == "delta":
            texts[i] += ev[1]
            token_ids[i] += ev[2]
            lps[i] += ev[3] or []
            continue
          reason = "error" if ev[0] == "error" else ev[1]
          logprobs = (
            _logprobs(("delta", texts[i], token_ids[i], lps[i]), chat, llm, sampling.logprobs)
            if sampling.logprobs
            else None
          )
          if chat:
            choices[i] = {
              "index": i,
              "message": {"role": "assistant", "content": texts[i]},
              "logprobs": logprobs,
              "finish_reason": reason,
            }
          else:
            choices[i] = {"index": i, "text": texts[i], "logprobs": logprobs, "finish_reason": reason}
          if ev[0] == "error":
            choices[i]["error"] = ev[1]
          if prompt_lps[i] is not None:
            choices[i]["prompt_logprobs"] = prompt_lps[i]
          break
    except asyncio.CancelledError:
      abort_all()
      raise
    return {
      "id": response_id,
      "object": obj,
      "created": created,
      "model": name,
      "choices": choices,
      "usage": usage(prompt_tokens, sum(map(len, token_ids))),
    }

  @app.post("/v1/completions")
  async def completions(request: Request):
    body = request.state.body = await body_of(request)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
      prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or isinstance(p, list) for p in prompt):
      prompts = prompt
    else:
      raise _BadRequest(f"'prompt' must be a string, a list of strings or token ids, got {prompt!r:.80}", "prompt")
    if any(isinstance(p, str) for p in prompts):
      tokenizer_needed("a text prompt")
    prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    return await run(request, prompts, _sampling(body, chat=False), bool(body.get("stream")), chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    body = request.state.body = await body_of(request)
    tokenizer_needed("chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
      raise _BadRequest("'messages' must be a non-empty list", "messages")
    messages = [{**m, "content": _content_text(m.get("content"))} if isinstance(m, dict) else m for m in messages]
    try:
      text = llm.tokenizer.apply_chat_template(messages)
    except Exception as e:  # the template's own errors (raise_exception) and malformed messages
      raise _BadRequest(f"messages: {e}", "messages") from None
    sampling = _sampling(body, chat=True)
    return await run(request, [text], sampling, bool(body.get("stream")), chat=True)

  return app


def _content_text(content):
  """A message's content: a string, or OpenAI's list of parts (its text parts joined)."""
  if isinstance(content, list):
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
  return content


def _logprobs(ev, chat: bool, llm: LLM, k: int):
  """OpenAI's log-probability objects for a delta's tokens: chat's ``content`` list or the legacy
  completions object (each token's own log-prob, and its top ``k`` candidates)."""
  _, _, ids, lps = ev
  if lps is None:
    return None
  tok = llm.tokenizer
  text = (lambda t: tok.decode([t], skip_special_tokens=False)) if tok is not None else str
  entries = []
  for t, cands in zip(ids, lps):
    lp = cands[t].logprob if t in cands else None
    entries.append(
      (text(t), lp, [(c.decoded_token or text(cid), c.logprob) for cid, c in cands.items() if c.rank <= k])
    )
  if chat:
    return {
      "content": [
        {
          "token": s,
          "logprob": lp,
          "bytes": list(s.encode()),
          "top_logprobs": [{"token": c, "logprob": v, "bytes": list(c.encode())} for c, v in top],
        }
        for s, lp, top in entries
      ]
    }
  return {
    "tokens": [s for s, _, _ in entries],
    "token_logprobs": [lp for _, lp, _ in entries],
    "top_logprobs": [dict(top) for _, _, top in entries],
    "text_offset": None,
  }


def _prompt_logprobs_json(entries: list) -> list:
  """vLLM's ``prompt_logprobs`` field: None for the first prompt token, then per token
  ``{"<id>": {"logprob", "rank", "decoded_token"}}``."""
  return [
    None
    if e is None
    else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token} for t, lp in e.items()}
    for e in entries
  ]


def _chunk(response_id, created, model, index, delta, finish_reason, chat, logprobs=None) -> dict:
  if chat:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
      "id": response_id,
      "object": "chat.completion.chunk",
      "created": created,
      "model": model,
      "choices": [choice],
    }
  return {
    "id": response_id,
    "object": "text_completion",
    "created": created,
    "model": model,
    "choices": [{"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
  }


def _sse(obj: dict) -> str:
  return f"data: {json.dumps(obj)}\n\n"


def serve(
  llm: LLM, *, host: str = "127.0.0.1", port: int = 8000, max_pending: int = 256, model_name: str | None = None
) -> None:
  """Serves until interrupted (uvicorn)."""
  import uvicorn

  app = build_app(llm, model_name=model_name, max_pending=max_pending)
  uvicorn.run(app, host=host, port=port, log_level="info")
