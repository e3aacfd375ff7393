"""``jaxkv serve`` through OpenAI's own client over loopback: completions, chat, streaming, stop
strings, n > 1, seeds, logprobs, errors, a full queue, and a bounded load whose every output equals
the offline API's for the same request (tokens depend only on the prompt, the seed and the output
index, never on the batch: docs/engine.md)."""

import asyncio
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")  # a dependency of the test extra: present in CI

from jaxkv import LLM, SamplingParams  # noqa: E402
from jaxkv.entrypoints.api_server import build_app  # noqa: E402

PROMPTS = [
  "Hello world!",
  "What is the capital of France?",
  "Tell me a story",
  "Numbers: 1 2 3",
  "The quick brown fox",
  "Once upon a time",
  "Paged KV-cache management",
  "JAX and Pallas",
]


def offline_params(i: int) -> SamplingParams:
  """Request i of the load: greedy, or seeded sampling with top-p / top-k (half each)."""
  if i % 2 == 0:
    return SamplingParams(max_tokens=5, temperature=0.0)
  return SamplingParams(max_tokens=5, temperature=0.9, top_p=0.95, top_k=40, seed=i % 7)


@pytest.fixture(scope="module")
def server():
  import uvicorn

  llm = LLM(max_num_seqs=8, max_num_batched_tokens=64)
  llm.engine.warmup()
  # The offline answers first, on the same engine (the server's thread owns it afterwards).
  want = {}
  for i in range(len(PROMPTS) * 2):
    p = PROMPTS[i % len(PROMPTS)]
    want[i] = llm.generate(p, offline_params(i))[0].outputs[0]
  chat_want = llm.chat([{"role": "user", "content": "Hi there"}], SamplingParams(max_tokens=6)).outputs[0]
  prompt_lps_want = llm.generate(PROMPTS[1], SamplingParams(max_tokens=2, prompt_logprobs=2))[0].prompt_logprobs
  app = build_app(llm, model_name="tiny", max_pending=64)
  config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
  srv = uvicorn.Server(config)
  thread = threading.Thread(target=srv.run, daemon=True)
  thread.start()
  for _ in range(200):
    if srv.started:
      break
    time.sleep(0.05)
  port = srv.servers[0].sockets[0].getsockname()[1]
  base = f"http://127.0.0.1:{port}"
  yield {
    "base": base,
    "client": openai.OpenAI(base_url=base + "/v1", api_key="none"),
    "want": want,
    "chat_want": chat_want,
    "prompt_lps_want": prompt_lps_want,
    "llm": llm,
    "app": app,
  }
  srv.should_exit = True
  thread.join(timeout=30)


def test_models_health_and_metrics(server):
  client = server["client"]
  assert [m.id for m in client.models.list().data] == ["tiny"]
  assert httpx.get(server["base"] + "/health").text == "ok"
  client.completions.create(model="tiny", prompt="Hello", max_tokens=2, temperature=0)
  text = httpx.get(server["base"] + "/metrics").text
  for name in (
    "jaxkv_num_requests_running",
    "jaxkv_num_requests_waiting",
    "jaxkv_kv_cache_usage_perc",
    "jaxkv_prefix_cache_hit_rate",
    "jaxkv_generation_tokens_per_second",
    "jaxkv_time_to_first_token_seconds_mean",
  ):
    assert name in text
  generated = [line for line in text.splitlines() if line.startswith("jaxkv_generation_tokens_total ")]
  assert float(generated[0].split()[1]) >= 2


def test_completion_equals_the_offline_api(server):
  client, want = server["client"], server["want"]
  for i in (0, 1, 2, 3):
    p = offline_params(i)
    got = client.completions.create(
      model="tiny",
      prompt=PROMPTS[i],
      max_tokens=p.max_tokens,
      temperature=p.temperature,
      top_p=p.top_p,
      seed=p.seed,
      extra_body={"top_k": p.top_k},
    )
    assert got.choices[0].text == want[i].text
    assert got.choices[0].finish_reason == want[i].finish_reason
    assert got.usage.completion_tokens == len(want[i].token_ids)


def test_chat_streamed_and_not(server):
  client, want = server["client"], server["chat_want"]
  messages = [{"role": "user", "content": "Hi there"}]
  got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
  assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
  pieces, reasons = [], []
  for chunk in client.chat.completions.create(
    model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True
  ):
    for c in chunk.choices:
      pieces.append(c.delta.content or "")
      reasons.append(c.finish_reason)
  assert "".join(pieces) == want.text and reasons[-1] == want.finish_reason


def test_stop_strings_n_seeds_and_logprobs(server):
  client, want = server["client"], server["want"]
  full = want[0].text
  stop = full[2:4]
  got = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0, stop=[stop])
  assert got.choices[0].text == full[: full.index(stop)] and got.choices[0].finish_reason == "stop"
  # n sequences seeded seed + i: twice the same, and not all equal.
  kw = dict(model="tiny", prompt="Tell me", max_tokens=8, temperature=1.0, n=3, seed=11)
  a = [c.text for c in sorted(client.completions.create(**kw).choices, key=lambda c: c.index)]
  b = [c.text for c in sorted(client.completions.create(**kw).choices, key=lambda c: c.index)]
  assert a == b and len(set(a)) > 1
  # No seed: fresh entropy per request.
  fresh = {
    client.completions.create(model="tiny", prompt="Tell me", max_tokens=8, temperature=1.0).choices[0].text
    for _ in range(3)
  }
  assert len(fresh) > 1
  lp = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=2)
  assert len(lp.choices[0].logprobs.tokens) == 3 and all(len(t) == 2 for t in lp.choices[0].logprobs.top_logprobs)
  assert all(v <= 0 for v in lp.choices[0].logprobs.token_logprobs)
  chat = client.chat.completions.create(
    model="tiny",
    messages=[{"role": "user", "content": "Hi"}],
    max_tokens=3,
    temperature=0,
    logprobs=True,
    top_logprobs=3,
  )
  assert all(len(t.top_logprobs) == 3 for t in chat.choices[0].logprobs.content)


def test_prompt_logprobs_as_vllm_serves_them(server):
  client, want = server["client"], server["prompt_lps_want"]
  expected = [None] + [{str(t): lp.logprob for t, lp in e.items()} for e in want[1:]]

  def values(entries):
    return [None if e is None else {t: v["logprob"] for t, v in e.items()} for e in entries]

  got = client.completions.create(
    model="tiny", prompt=PROMPTS[1], max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
  )
  assert values(got.choices[0].model_extra["prompt_logprobs"]) == expected
  streamed = [
    c.choices[0].model_extra.get("prompt_logprobs")
    for c in client.completions.create(
      model="tiny", prompt=PROMPTS[1], max_tokens=2, temperature=0, stream=True, extra_body={"prompt_logprobs": 2}
    )
  ]
  assert values(next(s for s in streamed if s is not None)) == expected


def test_bad_requests_answer_400_in_openais_shape(server):
  client = server["client"]
  with pytest.raises(openai.BadRequestError, match="temperature must be >= 0"):
    client.completions.create(model="tiny", prompt="x", temperature=-1)
  with pytest.raises(openai.BadRequestError, match="not served here"):
    client.completions.create(model="gpt-4", prompt="x")
  r = httpx.post(server["base"] + "/v1/completions", json={"model": "tiny", "prompt": [1, 2, 9999]})
  assert r.status_code == 400 and "token ids are integers in [0, 256)" in r.json()["error"]["message"]
  assert r.json()["error"]["type"] == "BadRequestError"
  r = httpx.post(server["base"] + "/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
  assert r.status_code == 400 and "roles are system, user and assistant" in r.json()["error"]["message"]


def test_a_full_server_answers_503(server):
  loop = server["app"].state.loop
  loop.max_pending, saved = 0, loop.max_pending
  try:
    r = httpx.post(server["base"] + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 503 and "unfinished requests" in r.json()["error"]["message"]
  finally:
    loop.max_pending = saved


def test_a_disconnected_stream_aborts_its_request(server):
  loop = server["app"].state.loop
  with httpx.stream(
    "POST",
    server["base"] + "/v1/completions",
    json={"prompt": "Hello", "max_tokens": 200, "stream": True, "temperature": 0},
  ) as r:
    next(r.iter_lines())
  for _ in range(100):  # the engine drops it within a few steps
    if not loop._streams and not server["llm"].engine.has_unfinished():
      break
    time.sleep(0.05)
  assert not loop._streams and not server["llm"].engine.has_unfinished()


def test_a_bounded_load_gives_the_offline_outputs(server):
  """200 requests, at most 32 streams open at once, half of them streamed."""
  want = server["want"]
  client = openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key="none")
  sem = asyncio.Semaphore(32)

  async def one(k: int):
    i = k % len(want)
    p = offline_params(i)
    kw = dict(
      model="tiny",
      prompt=PROMPTS[i % len(PROMPTS)],
      max_tokens=p.max_tokens,
      temperature=p.temperature,
      top_p=p.top_p,
      seed=p.seed,
      extra_body={"top_k": p.top_k},
    )
    async with sem:
      if k % 2:
        text = ""
        async for chunk in await client.completions.create(stream=True, **kw):
          text += "".join(c.text for c in chunk.choices)
        return i, text
      return i, (await client.completions.create(**kw)).choices[0].text

  async def main():
    return await asyncio.gather(*(one(k) for k in range(200)))

  results = asyncio.run(main())
  assert len(results) == 200
  mismatched = [(i, text, want[i].text) for i, text in results if text != want[i].text]
  assert not mismatched, mismatched[:3]
