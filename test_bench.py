"""bench.py end to end at its tiny preset on the CPU: it completes and writes well-formed JSON with
a row per variant. What it measures is not asserted: timings belong to the machine."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from model import ATTENTION, GPT, GPTConfig


def strict_json(text):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def positive_numbers(row, *keys):
    return all(isinstance(row[k], (int, float)) and math.isfinite(row[k]) and row[k] > 0 for k in keys)


def test_tiny_bench_writes_a_row_per_variant(tmp_path):
    out = tmp_path / "bench.json"
    # one thread: on a busy machine, threads waiting for each other at every tiny op take seconds
    run = subprocess.run(
        [sys.executable, "bench.py", "--preset=tiny", "--device=cpu", "--check", "--no-compiled_decode",
         f"--out={out}"],
        cwd=Path(__file__).parent, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result = strict_json(out.read_text())
    assert list(result["variants"]) == list(ATTENTION)
    assert not list(tmp_path.glob("*.tmp"))
    batch, contexts = result["decode"]["batch_size"], result["decode"]["contexts"]
    dtype = getattr(torch, result["decode"]["dtype"])  # hardware.native_dtype's: bf16 on a CPU with AMX
    for name, row in result["variants"].items():
        assert row["check"]["ok"], (name, row["check"])
        train = row["train"]
        assert positive_numbers(train, "ms_per_step", "optimizer_ms", "tokens_per_s", "x_mha")
        assert train["mfu"] is None
        assert [d["context"] for d in row["decode"]] == contexts
        model = GPT(GPTConfig(attn=name, **result["config"]))
        for d in row["decode"]:
            assert positive_numbers(d, "ms_per_token", "tokens_per_s", "step_alone_ms_per_token", "cache_mib",
                                    "cache_pct_mha", "x_mha")
            assert d["cache_mib"] * 2**20 == model.kv_cache_bytes(batch, d["context"], dtype)
        assert positive_numbers(row["uncached"], "cached_ms_per_token", "uncached_ms_per_token", "speedup")
        # a difference of two timings: noise can make it < 0
        assert math.isfinite(row["uncached"]["cached_ms_per_step"])
        assert f"| {name} |" in run.stdout
    mha = result["variants"]["mha"]
    assert mha["train"]["x_mha"] == 1 and all(d["x_mha"] == 1 for d in mha["decode"])
    config = result["config"]
    # the paper's 1/H + r/d_h, plus each head's key RMS that the decoder caches (+1/(2 d_h))
    H, d_h = config["n_head"], config["head_dim"]
    lrkv_share = 1 / H + config["lrkv_rank"] / d_h + 1 / (2 * d_h)
    assert math.isclose(result["variants"]["lrkv"]["decode"][0]["cache_pct_mha"], 100 * lrkv_share)
