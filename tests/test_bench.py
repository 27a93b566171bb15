"""tools/bench.py runs warm fused steps and reports speed and memory as JSON-ready numbers."""

import importlib.util
import json

from conftest import REPO, tiny_config


def test_bench_reports_all_measurements():
  spec = importlib.util.spec_from_file_location("bench", REPO / "tools" / "bench.py")
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  result = bench.bench(tiny_config(), steps=2)
  json.dumps(result)  # serialisable
  for key in ("rl_step_s", "compile_s", "sampler_tokens_per_s", "learner_tokens_per_s"):
    assert result[key] > 0, key
  assert 0 < result["sampling_share_of_step"] <= 1
  assert result["host_peak_rss_bytes"] > 0
  assert result["machine"]["platform"] == "cpu" and result["machine"]["device_count"] == 8
