import json
import pathlib
import subprocess
import sys

from jaxkv.cli import main


def test_inspect_json_glm(capsys):
  assert main(["inspect", "--config", "glm-5.3-flash", "--block-size", "1024", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert len(out["model"]["dsa_layers"]) == 11 and len(out["model"]["kda_layers"]) == 34
  plan = out["plan"]
  assert plan["block_size"] == 1024 and plan["layout"] == "packed"
  kinds = [g["kind"] for g in plan["kv_cache_groups"]]
  assert kinds[0] == "MLAAttentionSpec" and kinds[-1] == "CircularBufferSpec"
  idx = [ag for ag in plan["attention_groups"] if ag["backend"].startswith("glm5_indexer")][0]
  assert idx["kernel_block_size"] == 256 and idx["kv_cache_spec"]["resolved_block_stride_alignment"] == 8448


def test_inspect_text_and_errors(capsys):
  assert (
    main(
      ["inspect", "--config", "glm-5.3-flash-tiny", "--block-size", "256", "--memory-gib", "0.5", "--layout", "dense"]
    )
    == 0
  )
  text = capsys.readouterr().out
  assert "manager block size   256 tokens" in text and "glm5_indexer" in text
  assert main(["inspect", "--config", "glm-5.3-flash-tiny", "--block-size", "256", "--num-spec", "2", "--json"]) == 0
  widths = {g["kind"]: g["block_table_width"] for g in json.loads(capsys.readouterr().out)["plan"]["kv_cache_groups"]}
  assert widths["LinearAttentionStateSpec"] == 3 and widths["CircularBufferSpec"] == 1
  assert main(["inspect", "--block-size", "1024", "--kernel-block-size", "256"]) == 2
  err = capsys.readouterr().err
  assert "cannot be split into. Reduce --block-size to 256 or use --layout dense." in err


def test_module_entry_point_help():
  out = subprocess.run([sys.executable, "-m", "jaxkv", "inspect", "--help"], capture_output=True, text=True, check=True)
  assert "--layout" in out.stdout and "--json" in out.stdout


def test_a_foreign_models_package_on_the_path_is_named_not_imported(tmp_path):
  # jaxkv's sibling top-level packages (models, pallas_kernels) can clash with another
  # distribution's; the import must say so instead of loading the wrong one.
  (tmp_path / "models").mkdir()
  (tmp_path / "models" / "__init__.py").write_text("")
  out = subprocess.run(
    [sys.executable, "-c", "import jaxkv"],
    capture_output=True,
    text=True,
    cwd=tmp_path,
    env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
  )
  assert out.returncode == 1
  assert "ImportError: jaxkv needs its own top-level package 'models'" in out.stderr
  assert str(tmp_path / "models" / "__init__.py") in out.stderr


def test_generate_json_on_the_embedded_model(capsys):
  assert (
    main(["generate", "--prompt-ids", "5,6,7,8,9,10", "--batch", "2", "--max-tokens", "3", "--logprobs", "2", "--json"])
    == 0
  )
  out = json.loads(capsys.readouterr().out)
  a, b = out["requests"]
  assert len(a["output_token_ids"]) == 3 and a["output_token_ids"] == b["output_token_ids"]
  assert len(a["logprobs"][0]) == 2 and a["logprobs"][0][0][0] == a["output_token_ids"][0]
  assert main(["generate", "--prompt-ids", "5,6,7,8,9,10", "--max-tokens", "3", "--num-spec", "2", "--json"]) == 0
  spec = json.loads(capsys.readouterr().out)
  assert spec["requests"][0]["output_token_ids"] == a["output_token_ids"] and spec["draft_tokens"] > 0
  assert "random weights" in spec["acceptance_note"]  # why (almost) no draft is accepted
  # Text: the embedded tiny model ships a tokenizer.
  assert main(["generate", "--prompt", "Hello world!", "--max-tokens", "4", "--json"]) == 0
  text = json.loads(capsys.readouterr().out)["requests"][0]
  from jaxkv.tokenizer import Tokenizer, builtin_tokenizer_dir

  tok = Tokenizer(builtin_tokenizer_dir("glm-5.3-flash-tiny"))
  assert text["prompt_token_ids"] == tok.encode("Hello world!") and text["text"] == tok.decode(text["output_token_ids"])
  assert main(["generate", "--config", "glm-5.3-flash-mini", "--prompt", "hello"]) == 2  # no tokenizer shipped
  assert "--prompt-ids" in capsys.readouterr().err


def test_bench_json(capsys):
  args = ["bench", "--batch", "2", "--context", "9", "--steps", "3", "--buckets", "16"]
  args += ["--max-num-batched-tokens", "16", "--json"]
  assert main(args) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["decode_steps"] == 3 and out["decode_tokens"] == 6 and out["decode_tokens_per_s"] > 0
  assert out["compilations_at_end"] == out["compilations_after_warmup"]
  assert (out["tensor_parallel_size"], out["data_parallel_size"], out["enable_expert_parallel"]) == (1, 1, False)
  # Without the greedy variant: one executable fewer at warm-up, and the same tokens.
  assert main(["bench", *args[1:], "--no-greedy-step"]) == 0
  off = json.loads(capsys.readouterr().out)
  assert off["output_tokens_sha256"] == out["output_tokens_sha256"]
  assert out["greedy_step"] and not off["greedy_step"]
  assert off["compilations_at_end"] == off["compilations_after_warmup"]


def test_argument_errors_name_the_flag_before_any_model_is_built(capsys, tmp_path):
  import pytest

  for argv, message in [
    (["bench", "--steps", "0"], "--steps: expected an integer >= 1, got 0"),
    (["bench", "--batch", "0"], "--batch: expected an integer >= 1, got 0"),
    (["bench", "--context", "0"], "--context: expected an integer >= 1, got 0"),
    (["generate", "--batch", "0"], "--batch: expected an integer >= 1, got 0"),
  ]:
    with pytest.raises(SystemExit):
      main(argv)
    assert message in capsys.readouterr().err
  empty = tmp_path / "empty.json"
  empty.write_text("[]")
  for argv, message in [
    (["generate", "--prompt-ids", ""], "--prompt-ids must name at least one token id"),
    (["generate", "--batch-file", str(tmp_path / "none.json")], "none.json: no such file"),
    (["generate", "--batch-file", str(empty)], "must be a non-empty JSON list"),
    (["generate", "--batch-file", str(empty), "--batch", "3"], "a --batch-file already lists"),
    (
      ["generate", "--tensor-parallel-size", "2"],
      "--tensor-parallel-size 2 x --data-parallel-size 1 needs 2 devices; 1 are visible",
    ),
    (["bench", "--data-parallel-size", "2"], "--data-parallel-size 2 without --enable-expert-parallel"),
    (
      ["bench", "--long-prefill-token-threshold", "2", "--num-spec", "2"],
      "--long-prefill-token-threshold 2 must be 0 (off) or at least 1 + --num-spec = 3",
    ),
  ]:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_help_lists_the_built_in_configs_and_each_command_s_default(capsys):
  import pytest

  for command, default in (
    ("inspect", "glm-5.3-flash"),
    ("generate", "glm-5.3-flash-tiny"),
    ("bench", "glm-5.3-flash-tiny"),
  ):
    with pytest.raises(SystemExit):
      main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default {default})" in text and "glm-5.3-flash-slice4" in text, command


def test_a_model_larger_than_the_machine_is_refused_before_it_is_built(capsys, monkeypatch):
  import jaxkv.cli

  monkeypatch.setattr(jaxkv.cli, "_device_memory_bytes", lambda: (4 << 30, "host memory"))
  assert main(["generate", "--config", "glm-5.3-flash", "--dtype", "bfloat16"]) == 2
  err = " ".join(capsys.readouterr().err.split())
  assert "more than the 4.0 GiB of host memory" in err and "--force" in err
  gib = float(err.split("needs ")[1].split(" GiB")[0])
  assert 550 < gib < 700  # the released model in bf16 (about 305 B parameters)
  # What fits is built as before.
  assert main(["generate", "--max-tokens", "1", "--json"]) == 0


def test_readme_python_examples_run(capsys):
  """The README's ``python`` blocks, as a newcomer would paste them."""
  import pathlib
  import re

  readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
  assert len(blocks) >= 2
  for block in blocks:
    exec(compile(block, "README.md", "exec"), {})
  out = capsys.readouterr().out
  assert "KV-cache plan" in out and re.search(r"\[\d+(, \d+){7}\]", out)


def test_inspect_plot_draws_a_block(tmp_path, capsys):
  path = tmp_path / "block.png"
  assert (
    main(
      ["inspect", "--config", "glm-5.3-flash-tiny", "--block-size", "256", "--memory-gib", "0.05", "--plot", str(path)]
    )
    == 0
  )
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  from jaxkv.cache.kv_cache_plot import block_segments
  from kernel_utils import tiny_plan

  _, plan = tiny_plan(layout="packed", block_size=256)
  segs = block_segments(plan)
  # Every layer's page lies inside the arena row; the token group holds the latents and pooled keys.
  for group in segs.values():
    for s in group:
      assert 0 <= s["start"] and s["start"] + s["bytes"] <= plan.bytes_per_block
  assert {s["kind"] for s in segs[0]} == {"mla", "indexer"}


def test_every_flag_has_help_and_the_cache_flags_come_from_one_place():
  from jaxkv.cli import build_parser

  parser = build_parser()
  commands = parser._subparsers._group_actions[0].choices
  cache_flags = {
    "--block-size",
    "--kernel-block-size",
    "--layout",
    "--memory-gib",
    "--max-model-len",
    "--dtype",
    "--kv-cache-dtype",
    "--indexer-cache-dtype",
    "--linear-prefill",
    "--num-spec",
  }
  for name, sub in commands.items():
    flags = {f: a for a in sub._actions for f in a.option_strings}
    missing = [f for f, a in flags.items() if not a.help]
    assert not missing, (name, missing)
    assert cache_flags <= set(flags), name
    # Same choices and help everywhere; only the defaults differ (inspect plans the released model).
    assert flags["--kv-cache-dtype"].choices == commands["inspect"]._option_string_actions["--kv-cache-dtype"].choices


def test_generate_and_bench_with_prefix_caching(capsys, tmp_path):
  ids = ",".join(str(1 + (i * 7) % 200) for i in range(140))
  argv = [
    "generate",
    "--prompt-ids",
    ids,
    "--batch",
    "2",
    "--max-num-reqs",
    "1",
    "--block-size",
    "128",
    "--max-tokens",
    "2",
    "--logprobs",
    "2",
    "--json",
    "--max-num-batched-tokens",
    "128",
    "--buckets",
    "128",
    "--max-model-len",
    "256",
  ]  # one plan and one bucket for every run below: one compilation
  assert main(argv) == 0
  cold = json.loads(capsys.readouterr().out)["requests"]
  assert main(argv + ["--enable-prefix-caching"]) == 0
  warm = json.loads(capsys.readouterr().out)["requests"]
  # One row: the second copy is admitted after the first finished, and resumes after its first block.
  assert [r["num_cached_tokens"] for r in warm] == [0, 128] and [r["num_cached_tokens"] for r in cold] == [0, 0]
  assert [(r["output_token_ids"], r["logprobs"]) for r in warm] == [
    (r["output_token_ids"], r["logprobs"]) for r in cold
  ]
  # The disk tier outlives the command: a second run finds the first one's blocks there.
  disk = argv + [
    "--enable-prefix-caching",
    "--kv-offload",
    "disk",
    "--kv-offload-dir",
    str(tmp_path),
    "--preemption-mode",
    "swap",
    "--swap-space",
    "0.5",
  ]
  assert main(disk) == 0 and main(disk) == 0
  again = json.loads(capsys.readouterr().out.splitlines()[-1])["requests"]
  assert [r["num_cached_tokens"] for r in again] == [128, 128]
  assert [r["output_token_ids"] for r in again] == [r["output_token_ids"] for r in cold]
  assert main(["generate", "--kv-offload", "host"]) == 2
  assert "set --enable-prefix-caching" in capsys.readouterr().err
  assert (
    main(
      [
        "bench",
        "--batch",
        "2",
        "--context",
        "130",
        "--steps",
        "2",
        "--block-size",
        "128",
        "--max-num-batched-tokens",
        "128",
        "--buckets",
        "128",
        "--max-model-len",
        "256",
        "--enable-prefix-caching",
        "--json",
      ]
    )
    == 0
  )
  bench = json.loads(capsys.readouterr().out)
  assert bench["num_cached_tokens"] == 2 * 128 and bench["prefill_warm_s"] > 0


def test_the_readme_speculative_example_drafts_on_the_shipped_mtp_checkpoint(capsys):
  """README: ``--model-path tests/fixtures/hf/tiny-mtp --num-spec 3`` drafts; greedy tokens as without."""
  path = str(pathlib.Path(__file__).parent / "fixtures" / "hf" / "tiny-mtp")
  base = ["generate", "--model-path", path, "--prompt", "Hello world!", "--max-tokens", "5", "--json"]
  assert main(base) == 0
  plain = json.loads(capsys.readouterr().out)
  assert main(base + ["--num-spec", "3"]) == 0
  spec = json.loads(capsys.readouterr().out)
  assert spec["draft_tokens"] > 0 and spec["num_spec"] == 3
  assert spec["requests"][0]["output_token_ids"] == plain["requests"][0]["output_token_ids"]
  assert spec["requests"][0]["text"] == plain["requests"][0]["text"]
