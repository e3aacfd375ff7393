"""The conformance matrix's verdicts (benchmarks/conformance.py): bits are held equal within one
code version, and a resumed run on changed code is not reported as a bitwise failure."""

import copy
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import conformance  # noqa: E402


def _row(code, *, layout="packed", block_size=256, lp=-1.25, **settings):
  row = {"model": "tiny", **conformance.REFERENCE, "layout": layout, "block_size": block_size, **settings}
  tokens = [[3 + i for i in range(conformance.NEW_TOKENS)], [40 + i for i in range(conformance.NEW_TOKENS)]]
  row.update(
    code=code,
    device="NVIDIA H200",
    tokens=tokens,
    logprobs=[[[[t, lp], [99, lp - 1.0]] for t in toks] for toks in tokens],
    compiled_after_warmup=0,
    seconds=1.0,
  )
  return row


def test_same_code_must_agree_bitwise():
  rows = conformance.compare([_row("a"), _row("a", layout="dense", lp=-1.2500001)])
  assert rows[0]["pass"]
  assert not rows[1]["pass"] and "not bitwise" in rows[1]["problems"][0]


def test_versions_are_compared_among_themselves():
  rows = conformance.compare(
    [_row("a"), _row("b", layout="dense", lp=-1.2500001), _row("b", block_size=128, lp=-1.2500001)]
  )
  assert [r["pass"] for r in rows] == [True, True, True]
  assert [r["bitwise_group_size"] for r in rows] == [1, 2, 2]
  assert "2 code versions or devices (a on NVIDIA H200; b on NVIDIA H200" in conformance.markdown(rows)


def test_devices_are_compared_among_themselves():
  other = _row("a", layout="dense", lp=-1.2500001) | {"device": "NVIDIA H100 80GB HBM3"}
  rows = conformance.compare([_row("a"), other])
  assert all(r["pass"] for r in rows), [r["problems"] for r in rows]


def test_rows_without_a_version_form_their_own_group():
  old = _row(None)
  del old["code"], old["device"]
  rows = conformance.compare([old, _row("a", layout="dense", lp=-1.5)])
  assert all(r["pass"] for r in rows), [r["problems"] for r in rows]


def test_float32_tokens_are_checked_against_the_reference_of_their_version():
  ref_a, ref_b = _row("a"), _row("b")
  ref_b["tokens"][1][-1] = 7  # version b's float32 reference ends differently from version a's
  cell = copy.deepcopy(ref_b) | {"layout": "dense"}
  rows = conformance.compare([ref_a, ref_b, cell])
  full = f"{2 * conformance.NEW_TOKENS}/{2 * conformance.NEW_TOKENS}"
  assert rows[2]["pass"] and rows[2]["token_agreement"] == full
  # The same cell under version a's reference would have failed: the check is not vacuous.
  orphan = copy.deepcopy(cell) | {"code": "c"}
  rows = conformance.compare([ref_a, orphan])
  assert not rows[1]["pass"] and "float32 tokens differ" in rows[1]["problems"][0]


def test_code_version_follows_the_sources(tmp_path):
  for d in ("jaxkv", "pallas_kernels", "models"):
    (tmp_path / d).mkdir()
    (tmp_path / d / "a.py").write_text("x = 1\n")
  first = conformance.code_version(tmp_path)
  assert conformance.code_version(tmp_path) == first
  (tmp_path / "models" / "a.py").write_text("x = 2\n")
  assert conformance.code_version(tmp_path) != first


def test_a_resumed_matrix_reruns_errors_and_its_table_keeps_results(tmp_path, capsys):
  """h200.sh copies an earlier call's cells into each shard's file: the cell that ended in an error
  is not skipped, and in the table a later error never hides a cell's result."""
  ok = _row("a")
  failed = {k: v for k, v in _row("a", layout="dense").items() if k not in ("tokens", "logprobs")}
  failed["error"] = "RESOURCE_EXHAUSTED: out of memory"
  earlier = tmp_path / "shard-0.jsonl"
  earlier.write_text("\n".join(conformance.json.dumps(r) for r in (ok, failed)) + "\n")
  rerun = tmp_path / "shard-1.jsonl"  # the same earlier rows again (each shard's copy), then the rerun
  rerun.write_text(earlier.read_text() + conformance.json.dumps(_row("a", layout="dense")) + "\n")
  again = tmp_path / "shard-2.jsonl"
  again.write_text(earlier.read_text())
  assert conformance.main(["--markdown", str(rerun), str(again)]) == 0
  table = capsys.readouterr().out
  assert "FAIL" not in table and "2 of 2 cells pass" in table
  cell = conformance._row_key
  assert conformance.finished_cells([earlier]) == {cell(ok)}  # the errored cell runs again
  assert conformance.finished_cells([rerun]) == {cell(ok), cell(failed)}
