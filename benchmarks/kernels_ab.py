"""Interleaved A/B of kernels against a previous revision's files, in one process.

    mkdir -p /tmp/prev && git show REV:pallas_kernels/kpool.py > /tmp/prev/kpool.py
    python benchmarks/kernels_ab.py --previous /tmp/prev --out DIR [--variant 'ns2={"num_stages": 2}'] \
        [--candidate 'rewrite=/tmp/rewrite={"block_v": 16}']

For every kernel whose file is in ``--previous``, each size is timed in two rounds of previous,
current, the variants and the candidates (same inputs, same process, `benchmarks/kernels.py`'s
timing), so clock and bandwidth drift hit all alike; the second round's keys end in ``_again``.
``--variant`` times the current code with other tuning arguments, ``--candidate`` another file of the
kernel (a rewrite not yet in the tree: ``DIR/MODULE.py``), with tuning arguments if given. Results
go to ``DIR/kernels_ab.json`` after every size. ``benchmarks/kernels.py`` times the current code alone.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import kernels as K  # noqa: E402

# module -> (public function, benchmark, sizes)
KERNELS = {
  "sparse_mla_decode": (
    "sparse_mla_decode",
    K.bench_sparse_mla,
    [
      dict(batch=64, ctx=32768),
      dict(batch=1, ctx=32768),
      dict(batch=8, ctx=32768),
      dict(batch=32, ctx=1024),
      dict(batch=64, ctx=32768, cache_dtype="fp8"),
    ],
  ),
  "paged_mqa_logits": (
    "paged_mqa_logits",
    K.bench_mqa_logits,
    [dict(batch=1, ctx=131072), dict(batch=8, ctx=32768), dict(batch=64, ctx=32768), dict(batch=64, ctx=131072)],
  ),
  "kpool": ("kpool_compress_and_write", K.bench_kpool, [dict(tokens=128), dict(tokens=1024), dict(tokens=8192)]),
  "kda_recurrence": (
    "fused_recurrent_kda",
    K.bench_kda,
    [
      dict(reqs=1, tokens=2048),
      dict(reqs=2, tokens=1024),
      dict(reqs=32, tokens=64),
      dict(reqs=32, tokens=256),
      dict(reqs=32, tokens=1),
    ],
  ),
  "kda_chunk": (
    "chunk_kda",
    K.bench_kda_chunk,
    [dict(reqs=32, tokens=256), dict(reqs=1, tokens=2048), dict(reqs=2, tokens=1024), dict(reqs=16, tokens=128)],
  ),
  "cache_write": ("write_to_paged_cache", K.bench_cache_write, [dict(tokens=8), dict(tokens=1024), dict(tokens=8192)]),
}


def _load(path: pathlib.Path, name: str, label: str):
  spec = importlib.util.spec_from_file_location(f"{label}_{name}", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
  spec.loader.exec_module(module)
  return module


def _tuning(flag: str, spec: str, text: str) -> dict:
  """A ``--variant`` / ``--candidate`` flag's tuning arguments: a JSON object (empty: none)."""
  try:
    tune = json.loads(text) if text else {}
  except json.JSONDecodeError as e:
    raise ValueError(f"{flag} {spec!r}: its tuning is not JSON ({e}).") from None
  if not isinstance(tune, dict):
    raise ValueError(f"{flag} {spec!r}: its tuning must be a JSON object of keyword arguments.")
  return tune


def run(args):
  import pallas_kernels  # noqa: F401  (the package re-exports each function under its module's name)

  previous_dir = pathlib.Path(args.previous)
  variants, candidates = [], []
  for v in args.variant:
    name, _, tune = v.partition("=")
    if not name:
      raise ValueError(f"--variant {v!r}: want NAME=JSON.")
    variants.append((name, _tuning("--variant", v, tune)))
  for c in args.candidate:
    name, _, rest = c.partition("=")
    folder, _, tune = rest.partition("=")
    if not name or not folder:
      raise ValueError(f"--candidate {c!r}: want NAME=DIR or NAME=DIR=JSON (DIR holding MODULE.py).")
    candidates.append((name, pathlib.Path(folder), _tuning("--candidate", c, tune)))
  # Each name keys its row's results: a repeated one would overwrite another's.
  names = ["previous", "current", *(name for name, _ in variants), *(name for name, _, _ in candidates)]
  if repeated := sorted({n for n in names if names.count(n) > 1}):
    raise ValueError(f"--variant / --candidate names {repeated} more than once (previous and current are taken).")
  only = args.only.split(",") if args.only else list(KERNELS)
  if unknown := [m for m in only if m not in KERNELS]:
    raise ValueError(f"--only names {unknown}, not kernels of this benchmark: {list(KERNELS)}.")
  # A kernel named with nothing to compare must not pass as an empty run (2026-12-07: an uncarried folder).
  if args.only and (missing := [m for m in only if not (previous_dir / f"{m}.py").exists()]):
    have = sorted(x.name for x in previous_dir.glob("*.py"))
    raise ValueError(f"--previous {previous_dir} has no file for {missing} (it has {have}): add MODULE.py there.")
  for name, folder, _ in candidates:
    if missing := [m for m in only if (previous_dir / f"{m}.py").exists() and not (folder / f"{m}.py").exists()]:
      raise ValueError(f"--candidate {name}: {folder} has no file for {missing}: add MODULE.py there.")
  bw = K.measure_bandwidth(args.iters, args.repeats)
  print(f"measured bandwidth {bw / 1e12:.2f} TB/s", flush=True)
  result = {"bandwidth_Bps": bw, "iters": args.iters, "rows": []}
  for module_name, (fn_name, bench, sizes) in KERNELS.items():
    if module_name not in only or not (previous_dir / f"{module_name}.py").exists():
      continue
    module = importlib.import_module(f"pallas_kernels.{module_name}")
    current = getattr(module, fn_name)

    def load(folder, label):
      other = _load(folder / f"{module_name}.py", module_name, label)
      for name in getattr(module, "__all__", ()):  # the benchmarks build the current module's types
        if isinstance(getattr(module, name), type) and hasattr(other, name):
          setattr(other, name, getattr(module, name))
      return getattr(other, fn_name)

    one_round = [
      ("previous", load(previous_dir, "previous"), {}),
      ("current", current, {}),
      *[(name, current, tune) for name, tune in variants],
      *[(name, load(folder, f"candidate_{name}"), tune) for name, folder, tune in candidates],
    ]
    runs = one_round + [(f"{name}_again", fn, tune) for name, fn, tune in one_round]
    for kw in json.loads(args.sizes) if args.sizes else sizes:
      row = {"kernel": module_name, **kw}
      for name, fn, tune in runs:
        # The benchmarks import the kernel from its module at call time: swap it there.
        setattr(module, fn_name, functools.partial(fn, **tune) if tune else fn)
        try:
          t, nbytes = bench(**kw, impl="pallas", iters=args.iters, repeats=args.repeats)
          row[f"{name}_us"] = t * 1e6
          row[f"{name}_frac_bw"] = nbytes / t / bw
        except Exception as e:  # a variant that does not compile is a result too
          row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
          setattr(module, fn_name, current)
        print(
          module_name,
          kw,
          name,
          f"{row[f'{name}_us']:.1f} us" if f"{name}_us" in row else row[f"{name}_error"],
          flush=True,
        )
      result["rows"].append(row)
      if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kernels_ab.json").write_text(json.dumps(result, indent=1))
  return result


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--previous", required=True, help="directory of previous kernel files (MODULE.py)")
  p.add_argument("--out", help="directory for kernels_ab.json")
  p.add_argument("--only", metavar="MODULES", help=f"comma-separated, of {', '.join(KERNELS)} (default: all)")
  p.add_argument(
    "--variant",
    action="append",
    default=[],
    metavar="NAME=JSON",
    help="also time the current kernel with these tuning arguments",
  )
  p.add_argument(
    "--candidate",
    action="append",
    default=[],
    metavar="NAME=DIR[=JSON]",
    help="also time DIR/MODULE.py's kernel (a rewrite), with these tuning arguments if given",
  )
  p.add_argument(
    "--sizes", metavar="JSON", help='sizes to time instead of the defaults, e.g. \'[{"batch": 64, "ctx": 32768}]\''
  )
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--repeats", type=int, default=5)
  run(p.parse_args())


if __name__ == "__main__":
  main()
