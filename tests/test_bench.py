"""bench.py end to end at its tiny preset on the CPU: it completes and writes well-formed JSON with
a row per variant. What it measures is not asserted: timings belong to the machine."""

import json
import math

import pytest
import torch

from lib.attention.decode import last_logits
from lib.attention.layout import kv_cache_elements_per_token
from model import GPT, GPTConfig, VARIANTS
from tools import bench
from tools import serve as serve_tool


def strict_json(text):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def positive_numbers(row, *keys):
    return all(isinstance(row[k], (int, float)) and math.isfinite(row[k]) and row[k] > 0 for k in keys)


def test_tiny_bench_writes_a_row_per_variant(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # one thread: on a busy machine, threads waiting for each other at every tiny op take seconds
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench.main(["--preset=tiny", "--device=cpu", "--check", "--no-compiled_decode", f"--out={out}"])
    finally:
        torch.set_num_threads(threads)
    stdout = capsys.readouterr().out
    result = strict_json(out.read_text())
    assert list(result["variants"]) == list(VARIANTS)
    assert not list(tmp_path.glob("*.tmp"))
    # the preset's decode batch and contexts when no flag names others
    assert result["decode"]["batch_sizes"] == list(bench.PRESETS["tiny"]["decode_batches"]) == [2]
    assert result["decode"]["contexts"] == list(bench.PRESETS["tiny"]["contexts"])
    batch, contexts = 2, result["decode"]["contexts"]
    dtype = getattr(torch, result["decode"]["dtype"])  # the policy's for decoding (hardware.precision)
    for name, row in result["variants"].items():
        assert row["check"]["ok"], (name, row["check"])
        train = row["train"]
        assert positive_numbers(train, "ms_per_step", "optimizer_ms", "tokens_per_s", "x_mha")
        assert train["mfu"] is None
        assert [(d["batch_size"], d["context"]) for d in row["decode"]] == [(batch, L) for L in contexts]
        model = GPT(GPTConfig(attn=name, **result["config"]))
        for d in row["decode"]:
            assert positive_numbers(d, "ms_per_token", "tokens_per_s", "step_alone_ms_per_token", "cache_mib",
                                    "cache_pct_mha", "x_mha")
            assert d["cache_mib"] * 2**20 == model.kv_cache_bytes(batch, d["context"], dtype)
        assert positive_numbers(row["uncached"], "cached_ms_per_token", "uncached_ms_per_token", "speedup")
        # a difference of two timings: noise can make it < 0
        assert math.isfinite(row["uncached"]["cached_ms_per_step"])
        assert f"| {name} |" in stdout
    mha = result["variants"]["mha"]
    assert mha["train"]["x_mha"] == 1 and all(d["x_mha"] == 1 for d in mha["decode"])
    # serving: a row per storage, the cache's bytes a token as layout.py counts them, bf16 (int8: a byte
    # a number and a bf16 scale a row; int4: half a byte, and its lows and scales)
    serve = result["serve"]
    for name, row in serve["variants"].items():
        model = GPT(GPTConfig(attn=name, **result["config"]))
        plain, int8, int4 = row["serve"]
        assert plain["bytes_per_token"] == 2 * kv_cache_elements_per_token(model), name
        assert plain["bytes_per_token"] / 2 < int8["bytes_per_token"] < plain["bytes_per_token"], name
        assert plain["bytes_per_token"] / 4 < int4["bytes_per_token"] < int8["bytes_per_token"], name
        for r in row["serve"]:
            assert positive_numbers(r, "peak_in_flight", "tokens_per_s", "mean_ms_per_token"), name
        assert (row["batch1"] is None) == (name not in serve_tool.BATCH1), name
        assert row["batch1"] is None or positive_numbers(row["batch1"], "tokens_per_s", "mean_ms_per_token")
        assert f"| {name} | bfloat16 |" in stdout
    # each row's mean decode step against its roofline at the ceilings of the same run; the compared
    # variants' rows the median of ROUNDS runs, the others' one; the long workload serves the compared alone
    assert serve["workload"]["ceiling"] == result["serve_peaks"][-1]
    assert result["serve_peaks"][-1]["matmul"].endswith(str(serve_tool.DTYPE).removeprefix("torch."))
    for key in ("serve", "serve_long"):
        for name, row in result[key]["variants"].items():
            for r in row["serve"]:
                assert positive_numbers(r, "step_ms", "step_rows", "step_positions", "step_bytes",
                                        "step_flops", "roofline_ms", "x_roofline"), (key, name)
                assert r["rounds"] == (serve_tool.ROUNDS if name in serve_tool.COMPARED else 1), (key, name)
                assert r["x_roofline"] == pytest.approx(r["step_ms"] / r["roofline_ms"]), (key, name)
    assert sorted(result["serve_long"]["variants"]) == sorted(serve_tool.COMPARED)
    assert result["serve_long"]["workload"]["prompt"] == list(serve_tool.WORKLOADS["tiny-long"]["prompt"])
    config = result["config"]
    # the paper's 1/H + r/d_h, plus each head's key RMS that the decoder caches (+1/(2 d_h))
    H, d_h = config["n_head"], config["head_dim"]
    lrkv_share = 1 / H + config["lrkv_rank"] / d_h + 1 / (2 * d_h)
    assert math.isclose(result["variants"]["lrkv"]["decode"][0]["cache_pct_mha"], 100 * lrkv_share)


def test_decode_flags_sweep_every_batch_at_every_context(tmp_path):
    """--decode_batch and --contexts replace the preset's: a row per batch size and context, for
    every variant, with caches of that batch and context; a context past the preset's block_size
    grows the model's RoPE table to it."""
    out = tmp_path / "bench.json"
    bench.main(["--preset=tiny", "--device=cpu", "--only=decode", "--no-compiled_decode",
                "--decode_batch=3,1", "--contexts=16,80", f"--out={out}"])
    result = strict_json(out.read_text())
    assert result["decode"]["batch_sizes"] == [3, 1] and result["decode"]["contexts"] == [16, 80]
    assert result["config"]["block_size"] == 80 > bench.PRESETS["tiny"]["model"]["block_size"]
    dtype = getattr(torch, result["decode"]["dtype"])
    mha = result["variants"]["mha"]["decode"]
    for name, row in result["variants"].items():
        assert "train" not in row
        sweep = [(d["batch_size"], d["context"]) for d in row["decode"]]
        assert sweep == [(3, 16), (3, 80), (1, 16), (1, 80)]
        model = GPT(GPTConfig(attn=name, **result["config"]))
        for d, baseline in zip(row["decode"], mha):  # each row against MHA's at its batch and context
            assert d["cache_mib"] * 2**20 == model.kv_cache_bytes(d["batch_size"], d["context"], dtype)
            assert d["cache_pct_mha"] == 100 * d["cache_mib"] / baseline["cache_mib"]
            assert d["x_mha"] == d["ms_per_token"] / baseline["ms_per_token"]
            assert positive_numbers(d, "ms_per_token", "tokens_per_s", "step_alone_ms_per_token")
        # generate() at the first batch size and context
        assert (row["uncached"]["batch_size"], row["uncached"]["context"]) == (3, 16)


def test_kv_quant_decodes_from_each_storage_beside_the_plain_cache(tmp_path, capsys, monkeypatch):
    """--kv_quant: a row per storage at each batch size and context, for every variant, from a cache of
    that storage (its bytes, scales included: kv_cache_bytes with its class), and through the
    fixed-shape step's rounds (here last_logits eager, in place of its compiled form: compiling each
    storage takes a minute; test_decode and test_quant compile it); shares against MHA's with the
    first storage named; how each step reads the storage."""
    monkeypatch.setattr(bench, "compiled_step", last_logits)
    out = tmp_path / "bench.json"
    bench.main(["--preset=tiny", "--device=cpu", "--only=decode", "--attn=lrkv", "--contexts=32",
                "--kv_quant=none,int8,int4", "--compiled_decode", f"--out={out}"])
    result = strict_json(out.read_text())
    assert result["decode"]["kv_quant"] == ["none", "int8", "int4"]
    dtype = getattr(torch, result["decode"]["dtype"])
    mha_plain = result["variants"]["mha"]["decode"][0]
    stdout = capsys.readouterr().out
    for name, row in result["variants"].items():
        assert [d["kv_quant"] for d in row["decode"]] == ["none", "int8", "int4"]
        model = GPT(GPTConfig(attn=name, **result["config"]))
        for d in row["decode"]:
            cache_class = bench.cache_class(d["kv_quant"])
            assert d["cache_mib"] * 2**20 == model.kv_cache_bytes(2, 32, dtype, cache_class=cache_class)
            assert d["cache_pct_mha"] == 100 * d["cache_mib"] / mha_plain["cache_mib"]
            assert positive_numbers(d, "ms_per_token", "compiled_ms_per_token", "x_mha")
            # MHA's and LRKV's steps read a quantised cache's codes (quant.Codes), in C where quant.c is
            # built (on this CPU), and the table says so
            codes = "codes, C" if bench.quant_c.library() is not None else "codes"
            assert d["read"] == (None if d["kv_quant"] == "none" else codes)
            storage = result["decode"]["dtype"] if d["kv_quant"] == "none" else f"{d['kv_quant']}, {codes}"
            assert f"| {name} | 2 | 32 | {storage} | " in stdout
        # int4 is larger than int8 here: at 32 positions, under a key group of 64, its keys are held in
        # full precision until the group fills
        plain, int8, int4 = (d["cache_mib"] for d in row["decode"])
        assert plain > int8 and plain > int4


@pytest.mark.parametrize("flag, message", [
    ("--decode_batch=0", "argument --decode_batch: '0': not distinct positive integers, comma-separated"),
    ("--decode_batch=1,x", "argument --decode_batch: '1,x': not distinct positive integers, "
                           "comma-separated"),
    ("--decode_batch=", "argument --decode_batch: '': not distinct positive integers, comma-separated"),
    ("--contexts=64,64", "argument --contexts: '64,64': not distinct positive integers, "
                         "comma-separated"),
    ("--contexts=32,-8", "argument --contexts: '32,-8': not distinct positive integers, "
                         "comma-separated"),
    # the tiny preset decodes 4 tokens after 2 of warm-up, which need a prompt before them
    ("--kv_quant=int8,fp8", "argument --kv_quant: 'int8,fp8': not distinct names of none, int8, int4, "
                            "comma-separated"),
    ("--contexts=6,64", "--contexts: 6 is too short: the preset decodes 4 + 2 tokens after a prompt, "
                        "so at least 7"),
    ("--shared_prefix=-1", "--shared_prefix=-1: must be 0 or more tokens"),
])
def test_bad_decode_flags_are_refused_in_one_line(flag, message, tmp_path, capsys):
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as exit:
        bench.main(["--preset=tiny", "--device=cpu", flag, f"--out={out}"])
    assert exit.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.endswith(f": error: {message}")
    assert not out.exists()


@pytest.mark.parametrize("attn", ["mha", "gqa"])
def test_a_steps_flops_are_its_projections_a_row_and_its_attention_a_position(attn):
    """serve.step_flops by torch's counter on one token's exact step: every linear layer's 2 in out a row
    (the unembedding's included), and each cached position's q . k and a v, 2 d_h each, for every query
    head of every layer."""
    config = GPTConfig(attn=attn, **bench.PRESETS["tiny"]["model"])
    model = bench.inference_model(config, torch.device("cpu"), serve_tool.DTYPE)
    flops = serve_tool.step_flops(model, torch.device("cpu"))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    per_position = 4 * config.n_head * config.head_dim * config.n_layer
    assert flops == dict(per_row=2 * linear, per_position=per_position)


def test_a_shared_prefix_is_shared_where_the_engine_shares_and_computed_again_where_not(tmp_path, capsys):
    """--shared_prefix=16: every serving prompt begins with the same block of 16 tokens, which each request
    after the first takes from the first's blocks (bf16 and int8; int4's blocks are its key groups of 64,
    which no prompt here fills); with --no-share_prefixes, none does; the workload and the table say so."""
    for flag, shared in (("--share_prefixes", True), ("--no-share_prefixes", False)):
        out = tmp_path / f"bench{flag}.json"
        bench.main(["--preset=tiny", "--device=cpu", "--only=serve", "--attn=lrkv", "--shared_prefix=16",
                    flag, f"--out={out}"])
        result = strict_json(out.read_text())
        w = result["serve"]["workload"]
        assert (w["shared_prefix"], w["share_prefixes"]) == (16, shared)
        requests = w["requests"]
        for name, row in result["serve"]["variants"].items():
            plain, int8, int4 = (r["shared_tokens"] for r in row["serve"])
            assert (plain, int8, int4) == ((16 * (requests - 1),) * 2 if shared else (0, 0)) + (0,), name
        said = "blocks shared" if shared else "blocks not shared"
        assert f"every prompt after the same 16 tokens, {said}" in capsys.readouterr().out


def test_peaks_measures_both_ceilings_per_thread_count(tmp_path, capsys):
    """--peaks: a matmul's FLOP/s and a read's bandwidth, on a CPU at 1 thread and at torch's own
    number, which it leaves as it found it; --only=peaks measures nothing else."""
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    bench.main(["--preset=tiny", "--device=cpu", "--only=peaks", f"--out={out}"])
    result = strict_json(out.read_text())
    assert torch.get_num_threads() == threads
    assert result["variants"] == {}
    assert [p["threads"] for p in result["peaks"]] == sorted({1, threads})
    assert all(positive_numbers(p, "matmul_gflops", "read_gb_per_s") for p in result["peaks"])
    assert all(p["matmul"] == f"256^3 {result['decode']['dtype']}" for p in result["peaks"])  # its dtype
    assert "Ceilings (measure_peaks, best of 5): 1 thread: 256^3 " in capsys.readouterr().out


# each with what its line says: argparse's quoting of choices varies with the Python version
@pytest.mark.parametrize("args, says", [
    (["--preset=huge"], ["argument --preset: invalid choice: 'huge' (choose from ", "cpu", "tiny", "128m"]),
    (["--bogus"], ["unrecognized arguments: --bogus"]),
    (["--attn=mqa,foo"], ["argument --attn: foo: not one of mha, "]),
    (["--device=tpu"], ["--device=tpu: not a device; valid: auto, cuda, mps, cpu (CUDA_VISIBLE_DEVICES"]),
    (["--device=cpu:banana"], ["--device=cpu:banana: not a device; valid: auto, cuda, mps, cpu"]),
    ([f"--device={'mps' if torch.cuda.is_available() else 'cuda'}"], ["not available on this machine"]),
    (["--out={file}/bench.json"], ["{file}/bench.json: cannot be written: its folder is a file"]),
    (["--out={tmp}"], [": cannot be written: it is a folder"]),
])
def test_bad_flags_are_one_line_before_anything_runs(args, says, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    args = [a.format(file=tmp_path / "file", tmp=tmp_path) for a in args]
    with pytest.raises(SystemExit) as exit:
        bench.main(["--preset=tiny", *args])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith("bench.py: error: ") and err.count("\n") == 1
    assert all(part.format(file=tmp_path / "file") in err for part in says), err


def test_compiled_rounds_keep_a_graph_for_every_variant(monkeypatch):
    """All nine variants' compiled steps are kept at once for the interleaved rounds: under dynamo's
    default limit of 8 graphs for one function (GPT.last_logits), the ninth would run eager."""
    limits = []

    def step(model, token, cache):  # the compiled step, recording the limit it would compile under
        limits.append(torch._dynamo.config.recompile_limit)
        return torch.zeros(1, 1, 2)

    monkeypatch.setattr(bench, "compiled_step", step)
    monkeypatch.setattr(bench, "FixedKVCache", lambda cache: type("Fixed", (), {"pos": torch.zeros(1)})())
    view = type("ExactKVCache", (), {"cache": None})
    state = {attn: (view(), 0, torch.zeros(1, 1, dtype=torch.long), None, None) for attn in VARIANTS}
    assert len(state) > 8
    bench.compiled_rounds(dict.fromkeys(VARIANTS), state, 2, torch.device("cpu"))
    assert min(limits) >= len(VARIANTS)
