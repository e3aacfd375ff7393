"""The engine on a device mesh gives the single-device tokens: tensor, expert and data x tensor expert
parallelism on 8 CPU devices, a kernel-block split under tensor parallelism, and two processes under
``jax.distributed`` (gloo collectives), each loading the checkpoint by shard. Each run is a subprocess (``sharded_engine_worker.py``): the
CPU device count is fixed when JAX starts.

Tolerance: the row-parallel projections and the experts' partial sums add in another order on a
mesh, so top-5 log-probabilities agree to 1e-5 (measured: <= 1.5e-6), tokens and top-5 ids exactly.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

WORKER = pathlib.Path(__file__).parent / "sharded_engine_worker.py"
ROOT = WORKER.parent.parent


def _env(devices: int) -> dict:
  return {
    **os.environ,
    # A collective still waiting for a peer after 120 s fails, naming itself (XLA's default waits
    # far past the test's limit; see _run). A peer compiling the same program under load is
    # seconds behind, not minutes.
    "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} --xla_cpu_collective_timeout_seconds=120",
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": str(ROOT),
    "PYTHONFAULTHANDLER": "1",  # SIGABRT prints every thread's Python stack (see _run)
  }


def _run(cmds: list[list[str]], env: dict, timeout: float = 420) -> list[str]:
  """Runs the commands side by side and returns each one's stdout; fails with every process's
  stderr tail if one exits non-zero, or with their Python stacks if they outlive ``timeout``.

  Output goes to files, not pipes: a process whose unread pipe fills would block, and under
  ``jax.distributed`` its peer with it, inside a collective. A process that fails is given 30 s
  before its peers (then waiting on it in a collective) are stopped."""
  with tempfile.TemporaryDirectory() as tmp:
    files = [(open(f"{tmp}/{i}.out", "w+"), open(f"{tmp}/{i}.err", "w+")) for i in range(len(cmds))]
    procs = [subprocess.Popen(c, env=env, stdout=o, stderr=e, text=True) for c, (o, e) in zip(cmds, files)]
    deadline, failed_at = time.monotonic() + timeout, None
    while None in [p.poll() for p in procs]:  # a list: every process polled, so each returncode is set
      now = time.monotonic()
      if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
        failed_at = now
      if now > deadline or (failed_at is not None and now > failed_at + 30):
        for p in procs:
          if p.poll() is None:
            p.send_signal(signal.SIGABRT)  # faulthandler: the stacks where it waits
        time.sleep(5)
        for p in procs:
          p.kill()
          p.wait()
        break
      time.sleep(0.5)
    texts = []
    for o, e in files:
      o.seek(0)
      e.seek(0)
      texts.append((o.read(), e.read()))
      o.close()
      e.close()
  if any(p.returncode != 0 for p in procs):
    raise AssertionError(
      "\n".join(
        f"--- process {i}: exit {p.returncode}\n{err[-4000:]}" for i, (p, (_, err)) in enumerate(zip(procs, texts))
      )
    )
  return [out for out, _ in texts]


def _check_against(run: dict, base: dict, atol: float = 1e-5) -> None:
  assert run["tokens"] == base["tokens"]
  ids = lambda r: [[[i for i, _ in s] for s in steps] for steps in r["top5"]]
  lps = lambda r: [[[lp for _, lp in s] for s in steps] for steps in r["top5"]]
  assert ids(run) == ids(base)
  np.testing.assert_allclose(np.asarray(lps(run)), np.asarray(lps(base)), atol=atol)


def _run_worker(configs: str) -> dict:
  (out,) = _run([[sys.executable, str(WORKER), "--configs", configs]], _env(8))
  result = json.loads(out)
  assert result["device_count"] == 8
  for name, run in result["runs"].items():
    assert run["compiled_at_end"] == run["compiled_in_warmup"], f"{name} compiled after warm-up"
  return result


def test_tensor_expert_and_data_parallel_match_one_device():
  # 4x2e: experts over all 8 devices, heads over 2, and preemption by swapping; 1x4e: heads and
  # experts over 4, with prefix caching and host offload; 2x2e-dense: both, in the dense layout,
  # where the KDA states are split by head. (Three worker runs, not one: pytest's workers run them
  # side by side.)
  result = _run_worker("1x1,4x2e-swap,1x4e-prefix,2x2e-dense-prefix-swap")
  base = result["runs"]["1x1"]
  assert base["tokens"] == result["hf_greedy"]
  for name in ("4x2e-swap", "1x4e-prefix", "2x2e-dense-prefix-swap"):
    _check_against(result["runs"][name], base)
  # On the mesh, prompts served again start from their cached first block and say the same, bitwise,
  # whether the block is still on the devices or comes back from the host offload tier (the KDA
  # state checkpoints of the dense run too: each device copies and offloads its heads' share).
  for name in ("1x4e-prefix", "2x2e-dense-prefix-swap"):
    prefix = result["runs"][name]
    assert prefix["cold"]["cached"] == 0 and prefix["warm"]["cached"] == prefix["offloaded"]["cached"] == 2 * 128
    assert prefix["loaded_from_host"] > 0
    for key in ("warm", "offloaded"):
      assert prefix[key]["tokens"] == prefix["cold"]["tokens"] and prefix[key]["top5"] == prefix["cold"]["top5"], key
  # Requests swapped out to the host and back on the mesh produce what they produce unpreempted.
  for name in ("4x2e-swap", "2x2e-dense-prefix-swap"):
    swap = result["runs"][name]["swap"]
    assert swap["swapped_out"] > 0 and swap["swapped_in"] == swap["swapped_out"], name
    assert swap["swapped"] == swap["roomy"], name
  # Each device holds half of every KDA state row (its heads) and all of the other caches; packed,
  # every cache is one copy per device.
  rows = result["runs"]["2x2e-dense-prefix-swap"]["cache_rows"]
  kda = {n for n in rows if n.endswith(".kda")}
  assert kda and all(rows[n][0] == 2 * rows[n][1] for n in kda)
  assert all(whole == mine for n, (whole, mine) in rows.items() if n not in kda)
  assert all(whole == mine for whole, mine in result["runs"]["1x4e-prefix"]["cache_rows"].values())


def test_pallas_kernels_per_device_match_one_device():
  # Tensor parallel 2 with the Pallas kernels (interpreted; KDA and sparse MLA per device on their
  # heads, paged MQA on its rows) in the dense layout, against the same kernels on one device
  # (which test_engine_equivalence.py holds to the XLA path). The XLA path in the packed layout
  # runs tensor parallel 2 in the two-process test.
  result = _run_worker("1x1-pallas,1x2-dense-pallas")
  assert result["runs"]["1x1-pallas"]["tokens"] == result["hf_greedy"]
  _check_against(result["runs"]["1x2-dense-pallas"], result["runs"]["1x1-pallas"])


def test_chunked_prefill_on_a_mesh_matches_one_device():
  # Tensor parallel 2 in the dense layout: each device reads and writes its heads' share of the
  # KDA pages, the unfinished chunk's rows included, and runs chunk_kda on its heads.
  result = _run_worker("1x1-dense-chunked,1x2-dense-chunked")
  _check_against(result["runs"]["1x2-dense-chunked"], result["runs"]["1x1-dense-chunked"])


def test_mtp_drafting_on_a_mesh_matches_one_device():
  # Data 2 x tensor 2 with expert parallelism drafting with the MTP layer (k = 2) on a random model.
  result = _run_worker("1x1-mtp,2x2e-mtp")
  _check_against(result["runs"]["2x2e-mtp"], result["runs"]["1x1-mtp"])
  assert result["runs"]["2x2e-mtp"]["drafts"] > 0


_NAN_AT_LOAD = """
import json, sys, warnings
import jax.numpy as jnp
from jaxkv.engine import make_mesh
from models.glm5_next.checkpoint import load_checkpoint
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  _, model = load_checkpoint(sys.argv[1], dtype=jnp.float32, mesh=make_mesh(2, 2))
print(json.dumps([str(w.message) for w in caught if w.category is RuntimeWarning]))
"""


def test_an_infinity_in_one_shard_is_said_at_load(tmp_path):
  """On a 2x2 mesh each device checks its own blocks (no collective at load): one infinity in the
  vocabulary split of ``lm_head`` is named."""
  from safetensors.numpy import load_file, save_file

  tensors = load_file(ROOT / "tests" / "fixtures" / "hf" / "tiny" / "model.safetensors")
  row = tensors["lm_head.weight"].shape[0] - 1  # the last device's block of the split
  tensors["lm_head.weight"][row, 3] = np.inf
  (tmp_path / "config.json").write_text((ROOT / "tests" / "fixtures" / "hf" / "tiny" / "config.json").read_text())
  save_file(tensors, tmp_path / "model.safetensors")
  (out,) = _run([[sys.executable, "-c", _NAN_AT_LOAD, str(tmp_path)]], _env(4))
  (message,) = json.loads(out.strip().splitlines()[-1])
  assert "NaN or infinite values in 1 tensors (['lm_head.weight'])" in message


def _two_processes() -> list[str]:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  cmd = [sys.executable, str(WORKER), "--configs", "1x2", "--coordinator", f"localhost:{port}", "--num-processes", "2"]
  return _run([cmd + ["--process-id", str(i)] for i in range(2)], _env(1))


def test_two_processes_under_jax_distributed_match_hf():
  outs = _two_processes()
  # Process 0 prints the JSON as its last line (gloo logs its connections to stdout before it).
  result = json.loads(outs[0].strip().splitlines()[-1])
  assert '"runs"' not in outs[1]
  assert result["process_count"] == 2 and result["device_count"] == 2
  run = result["runs"]["1x2"]
  assert run["tokens"] == result["hf_greedy"]
  # Each process places its own copy of the step's inputs: no per-step all-gather and host sync
  # to check the processes agree (jax.device_put's multihost_utils.assert_equal).
  assert run["cross_process_checks"] == 0
  # Loaded by shard: process 0 read exactly what its device holds, less than the whole model.
  assert run["loaded"]["read"] == run["loaded"]["held"] < run["loaded"]["model"]
