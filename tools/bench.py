"""
What each attention variant costs, all at one configuration, in one process.

Precision is the policy's for each use (hardware.precision: training autocast, Newton-Schulz,
decoding, each in whichever of bf16 and fp32 the device runs faster); the first line says which
and why, and --dtype sets all three.

Training: forward, backward and train.py's optimizer step on random tokens (bf16 autocast where
the policy trains in it; torch.compile on a GPU), timed after warm-up, median of several steps: ms,
tokens/s, MFU and the time relative to MHA.

Decoding: prefill a prompt, then feed one token at a time until the KV cache, sized to the
context length, is full, every variant in turn over several rounds (bench_decode), at every
decode batch size and context of the preset or of --decode_batch and --contexts: ms per new
token back to back and a step alone, tokens/s, the MiB its buffers hold and their share of
MHA's. With --kv_quant, each variant decodes from each cache storage in turn (lib/attention/quant.py:
none, the decoding dtype's; int8; int4), a row each, every row's shares relative to MHA's with the
first storage named. At the first batch size and context, generate() with and without the cache
shows what the cache buys. With --random_caches, the caches are filled with random entries instead of a
prefill (a step's cost does not depend on the values it reads, and a 16 x 8,192 prefill takes
minutes on a CPU), and generate() is left out. Decoding holds weights and cache alike in the
policy's dtype for decoding, as a server would (autocast would re-cast every weight at every
token). Eager, the caches grow by one position a step and on a GPU every step pays its kernel
launches; compiled, the step runs on fixed shapes (decode.py: the whole cache under a position
mask), as one CUDA graph on a GPU; the seconds its compiling takes are reported apart.

    python -m tools.bench --preset=cpu
    python -m tools.bench --preset=cpu --only=decode --decode_batch=1,16 --contexts=2048,8192
    python -m tools.bench --preset=cpu --only=decode --kv_quant=none,int8,int4  # docs/decoding.md
    OMP_NUM_THREADS=1 python -m tools.bench --only=decode --decode_batch=1,16 --contexts=2048,8192 \
        --dtype=float32 --random_caches --no-compiled_decode --new_tokens=4 --peaks  # docs/decoding.md
    python -m tools.bench --preset=128m --device=cuda --check --out=bench_gpu.json

Serving (tools/serve.py): one seeded workload of requests at one KV budget through continuous
batching over a paged cache, every variant with each cache storage (bf16, int8, int4), against the
same requests through batch-1 generate: sequences in flight, tokens/s, ms per token, preemptions,
and the mean decode step against its roofline on the ceilings (measure_peaks) of the same run; then
the preset's decode-dominated workload (serve.LONG) for the compared variants (serve.COMPARED).

    python -m tools.bench --preset=cpu --only=serve

With --peaks, first the two ceilings of a roofline (measure_peaks): a square matmul's FLOP/s and
the bandwidth of reading a tensor much larger than the caches.

Prints markdown tables and writes the same numbers to --out as JSON, rewritten after each
variant's training and after decoding, so that a run cut short keeps what it measured.
"""

import argparse
import itertools
import json
import math
import platform
import re
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.nn.attention import SDPBackend, sdpa_kernel

from lib.training.checkpoint import check_writable
from lib.training.configurator import ArgumentParser, ConfigError, run_main
from lib.attention.decode import (CODE_STEPS, ExactKVCache, FixedKVCache, compiled_step, exact_step, generate,
                                  registered_step)
from lib.attention import quant_c
from lib.attention.quant import CACHES, cache_class
from lib.training.hardware import DEVICES, PRECISION_NAMES, USES, peak_flops, pick_device, precision
from model import GPT, GPTConfig, VARIANTS
from lib.training.data import atomic_open
from lib.training.recipe import TrainConfig, configure_optimizers, flops_per_token, optimizer_step
from tools import serve

PRESETS = {
    # The paper's 128M model and batch: 16 x 2048 tokens a step. Decoding a batch of 16 makes
    # reading the cache a visible share of a step next to the kernel launches.
    "128m": dict(model={}, batch_size=16, seq_len=2048, warmup=3, steps=10,
                 decode_batches=(16,), contexts=(512, 2048), new_tokens=32, peaks=(8192, 4096)),
    # One layer of the 128M as it is (6 heads x 128, r = 46, d_c = 128 + 64) and its vocabulary
    # per layer (50304 / 12 ~ 4096), so that each variant's projections weigh what they weigh at
    # 128M: under 3 minutes on 2 cores, compiling included (docs/benchmarks.md). Muon's share of
    # a step is not the 128M's: its Newton-Schulz iterations cost the same at 1,024 tokens a step
    # as at 32,768.
    "cpu": dict(model=dict(n_layer=1, vocab_size=4096), batch_size=1, seq_len=1024, warmup=1, steps=3,
                decode_batches=(1,), contexts=(512, 2048), new_tokens=32, peaks=(4096, 1024)),
    # For the test: seconds on a CPU.
    "tiny": dict(model=dict(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64, head_dim=16,
                            n_kv_head=2, kv_lora_rank=16, rope_head_dim=8, lrkv_rank=4, gta_kv_heads=2,
                            gla_latent_dim=16, mlra_latent_dim=8),
                 batch_size=2, seq_len=64, warmup=1, steps=2, decode_batches=(2,), contexts=(32, 64),
                 new_tokens=4, peaks=(256, 64)),
}
# Every row is relative to the registry's first variant, MHA, as the paper compares everything with
# it; the JSON keys x_mha and cache_pct_mha say so
BASELINE = next(iter(VARIANTS))
DECODE_WARMUP = 2  # untimed tokens after each prefill
DECODE_ROUNDS = 5  # rounds of interleaved decoding (bench_decode)
# the backends F.scaled_dot_product_attention may pick on a GPU for training (math is its fallback)
SDPA_BACKENDS = dict(flash=SDPBackend.FLASH_ATTENTION, cudnn=SDPBackend.CUDNN_ATTENTION,
                     efficient=SDPBackend.EFFICIENT_ATTENTION)
MIB = 2**20
T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def clock(device):
    """Seconds, once the work queued on the device is done; on a CPU at one thread, the process's CPU
    time: a core that other jobs share costs wall time, not CPU time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    one_core = device.type == "cpu" and torch.get_num_threads() == 1
    return time.process_time() if one_core else time.perf_counter()


def inference_model(config, device, dtype):
    """A model with every weight random: the real init zeroes each W_o and MLP W_out, so attention
    would never reach the logits (the check would pass trivially) and a GPU multiplies zeros
    faster than real weights."""
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for block in model.blocks:
            for W in (block.attn.W_o.weight, block.mlp.W_out.weight):
                W.uniform_(-math.sqrt(3 / W.size(1)), math.sqrt(3 / W.size(1)))
    return model.to(device, dtype).eval()


def check(config, preset, device, dtype):
    """The training path's attention runs on the flash backend (forward and backward), and cached
    decoding gives the full forward's logits."""
    model = inference_model(config, device, dtype)
    T, n = preset["contexts"][0], preset["new_tokens"]
    idx = torch.randint(config.vocab_size, (2, T), device=device)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            model(idx, idx)[1].backward()
        flash_error = None
    except RuntimeError as e:
        flash_error = str(e).splitlines()[0]
    with torch.inference_mode():
        full = model(idx)[0]
        cache = model.new_cache(2, T, dtype)
        steps = [model(idx[:, :T - n], cache=cache)[0]]
        steps += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(T - n, T)]
        cached = torch.cat(steps, dim=1)
    rel_err = ((cached - full).norm() / full.norm()).item()
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    return dict(flash_error=flash_error, decode_rel_err=rel_err, decode_tol=tol,
                ok=flash_error is None and rel_err < tol)


def sdpa_in_use(forward, x, y, autocast):
    """The attention ops and kernels one forward and backward runs, as the profiler names them:
    aten::_scaled_dot_product_{flash,cudnn,efficient}_attention and their kernels. None of them
    means the math fallback (which compiled code inlines as plain matmuls)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        with autocast:
            loss = forward(x, y)[1]
        loss.backward()
        torch.cuda.synchronize()
    events = prof.key_averages()
    ops = sorted(e.key.removeprefix("aten::_scaled_dot_product_") for e in events
                 if e.key.startswith("aten::_scaled_dot_product_"))
    # inductor names its own kernels after the ops they feed: leave them out
    kernels = sorted(e.key[:120] for e in events if e.device_type == DeviceType.CUDA
                     and re.search("flash|cudnn|fmha|sdpa", e.key, re.IGNORECASE)
                     and not e.key.startswith("triton_"))
    return dict(ops=ops, kernels=kernels)


def sdpa_backend_ms(config, preset, device):
    """The model's forward and backward in ms (median of 3 after 1), PyTorch's choice and each SDPA
    backend forced, or the backend's error. Eager, because compiling once per backend would take
    minutes; compiled code calls the same attention kernels."""
    torch.manual_seed(0)
    model = GPT(config).to(device)
    B, T = preset["batch_size"], preset["seq_len"]
    x, y = torch.randint(config.vocab_size, (2, B, T), device=device)
    result = {}
    for name, backend in dict(default=None, **SDPA_BACKENDS).items():
        times = []
        try:
            with sdpa_kernel(backend) if backend else nullcontext():
                for _ in range(4):
                    t0 = clock(device)
                    with torch.autocast("cuda", torch.bfloat16):
                        loss = model(x, y)[1]
                    loss.backward()
                    times.append(clock(device) - t0)
            result[name] = 1000 * statistics.median(times[1:])
        except RuntimeError as e:
            result[name] = str(e).splitlines()[0]
        model.zero_grad(set_to_none=True)
    return result


def bench_train(config, preset, device, dtype, ns_dtype, compile, profile):
    """train.py's step without its data: forward and backward, then the gradient clip and the
    paper's optimisers, whose share is timed too (it does not grow with the batch). With profile,
    on a GPU, also which attention kernels the step runs (sdpa_in_use)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    cfg = TrainConfig()
    model = GPT(config).to(device)
    optimizers = configure_optimizers(model, cfg, ns_dtype=ns_dtype)
    forward = torch.compile(model) if compile else model
    autocast = torch.autocast(device.type, torch.bfloat16) if dtype == torch.bfloat16 else nullcontext()
    B, T = preset["batch_size"], preset["seq_len"]
    x, y = torch.randint(config.vocab_size, (2, B, T), device=device)
    steps, optimizer_times = [], []
    for _ in range(preset["warmup"] + preset["steps"]):
        t0 = clock(device)
        with autocast:
            loss = forward(x, y)[1]
        loss.backward()
        t1 = clock(device)
        optimizer_step(model, optimizers, cfg)
        t2 = clock(device)
        steps.append(t2 - t0)
        optimizer_times.append(t2 - t1)
    log(f"  warm-up (compile included) {sum(steps[:preset['warmup']]):.1f}s")
    sdpa = sdpa_in_use(forward, x, y, autocast) if profile and device.type == "cuda" else None
    model.zero_grad(set_to_none=True)
    ms = 1000 * statistics.median(steps[preset["warmup"]:])
    tokens_per_s = B * T * 1000 / ms
    peak = peak_flops(device)
    mfu = flops_per_token(model, T) * tokens_per_s / peak if peak else None
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return dict(ms_per_step=ms, optimizer_ms=1000 * statistics.median(optimizer_times[preset["warmup"]:]),
                tokens_per_s=tokens_per_s, mfu=mfu, max_memory_gib=memory, sdpa=sdpa)


@torch.inference_mode()
def bench_decode(configs, preset, device, dtype, compiled, measured=lambda rows: None, random_caches=False,
                 kv_quant=("none",)):
    """{variant: (rows, generate's row)} for every config at once, interleaved: a row per decode
    batch size, context (the preset's decode_batches and contexts) and cache storage (kv_quant's
    names), batch by batch. Per batch size and context, each variant is prefilled, into a cache of
    each storage, to the same position; then in each of
    DECODE_ROUNDS rounds every variant and storage in turn runs the n steps that fill its cache, over the same
    positions each round, twice: each step on its own (the device drained before and after it)
    and back to back with one drain at the end, as generate() runs them (on a GPU the host then
    queues the next step while the device runs this one). A machine whose load drifts (a busy
    CPU) slows every variant of a round alike, where variants measured one after another would
    each see another load. ms_per_token: the median of the back-to-back rounds;
    step_alone_ms_per_token: the median single step. With compiled, then the same rounds of the
    compiled fixed-shape step, compiled (a graph per variant, batch size and context) before they
    start: compiled_ms_per_token. measured(rows) is called after each batch size and context with
    the rows so far, so that a run cut short keeps them. With random_caches, each variant's caches
    are filled to that position with random entries (fill_randomly) instead of by a prefill, and
    generate()'s row is None. generate() decodes from the plain cache (storage none)."""
    n = preset["new_tokens"]
    models = {attn: inference_model(config, device, dtype) for attn, config in configs.items()}
    vocab_size = next(iter(configs.values())).vocab_size  # one preset: the same for every variant
    rows = {attn: [] for attn in configs}
    for B, L in itertools.product(preset["decode_batches"], preset["contexts"]):
        prompt = torch.randint(vocab_size, (B, L - DECODE_WARMUP - n), device=device)
        state = {}
        for (attn, model), storage in itertools.product(models.items(), kv_quant):
            cache = model.new_cache(B, L, dtype, cache_class=cache_class(storage))
            if random_caches:
                token = fill_randomly(model, cache, prompt)
            else:
                token = model(prompt, cache=cache)[0][:, -1:].argmax(-1)
            cache = ExactKVCache(cache)  # each step through its variant's own
            for _ in range(DECODE_WARMUP):
                token = model(token, cache=cache)[0].argmax(-1)
            state[attn, storage] = (cache, cache.pos, token, [], [])
        runs = {key: models[key[0]] for key in state}  # (variant, storage): its model
        for _ in range(DECODE_ROUNDS):
            for key, (cache, start, token, alone, back_to_back) in state.items():
                cache.pos = start
                for _ in range(n):
                    t0 = clock(device)
                    token = runs[key](token, cache=cache)[0].argmax(-1)
                    alone.append(clock(device) - t0)
                cache.pos = start
                t0 = clock(device)
                for _ in range(n):
                    token = runs[key](token, cache=cache)[0].argmax(-1)
                back_to_back.append((clock(device) - t0) / n)
        fixed = compiled_rounds(runs, state, n, device) if compiled else {}
        for (attn, storage), (cache, _, _, alone, back_to_back) in state.items():
            ms = 1000 * statistics.median(back_to_back)
            mib = sum(buf.nbytes for layer in cache.cache.layers for buf in layer.values()) / MIB
            compiled_ms, compile_s = fixed.get((attn, storage), (None, None))
            rows[attn].append(dict(batch_size=B, context=L, kv_quant=storage,
                                   read=read(models[attn], storage), ms_per_token=ms,
                                   tokens_per_s=B * 1000 / ms,
                                   step_alone_ms_per_token=1000 * statistics.median(alone), cache_mib=mib,
                                   compiled_ms_per_token=compiled_ms, compile_s=compile_s))
        del state
        measured(rows)
    if random_caches:
        return {attn: (rows[attn], None) for attn in configs}
    # generate() prefills and samples as a user would: per new token, prefill included, and (from
    # the difference with a 1-token call) per step, at the same batch and context as the first row
    B, L = preset["decode_batches"][0], preset["contexts"][0]
    prompt = torch.randint(vocab_size, (B, L - n), device=device)
    result = {}
    for attn, model in models.items():
        seconds = {}
        for use_cache, new in ((True, 1), (True, n), (False, n)):
            t0 = clock(device)
            step = exact_step if use_cache else None
            generate(model, prompt, new, temperature=0, use_cache=use_cache, step=step)
            seconds[use_cache, new] = clock(device) - t0
        cached, uncached = 1000 * seconds[True, n] / n, 1000 * seconds[False, n] / n
        step = 1000 * (seconds[True, n] - seconds[True, 1]) / (n - 1)
        result[attn] = rows[attn], dict(batch_size=B, context=L, new_tokens=n,
                                        cached_ms_per_token=cached, cached_ms_per_step=step,
                                        uncached_ms_per_token=uncached, speedup=uncached / cached)
    return result


def read(model, storage):
    """How a decoding step reads a quantised storage: "codes" where the variant's step is one of
    decode.CODE_STEPS (quant.Codes: the products over the codes), "codes, C" where quant.c takes them (a
    CPU with a C compiler), "dequantised" where it takes load's full-precision copy of the cache; None for
    the plain storage."""
    if storage == "none":
        return None
    if registered_step(model.blocks[0].attn) not in CODE_STEPS:
        return "dequantised"
    return "codes, C" if quant_c.takes(model.lm_head.weight) else "codes"


def fill_randomly(model, cache, prompt):
    """Fill model's cache to where a prefill of prompt (B, T) would leave it, with random entries (each
    key RMS in [0.5, 1.5], as a RMS is positive; a quantised cache's codes random too, its bookkeeping
    of int64 left), after a prefill of its first token; return the token that a prefill would have
    drawn, a random one."""
    model(prompt[:, :1], cache=cache)
    cache.pos = prompt.size(1)
    for layer in cache.layers:
        for name, buf in layer.items():
            if buf.is_floating_point():
                buf.uniform_(0.5, 1.5) if name == "rho" else buf.uniform_(-0.5, 0.5)
            elif buf.dtype in (torch.int8, torch.uint8):
                buf.random_(0, 128)
    return torch.randint_like(prompt[:, :1], int(prompt.max()) + 1)


def compiled_rounds(models, state, n, device):
    """{key: (ms per token, s to compile)} of the compiled fixed-shape step of models[key] over
    bench_decode's positions (state[key]): the caches fixed at the rounds' start, two steps to
    compile (and on a GPU record the CUDA graph; the seconds of the first, less a step, are the
    compile time), then DECODE_ROUNDS interleaved rounds of n steps back to back, the median round."""
    torch._dynamo.reset()  # a graph per variant and context: more than dynamo keeps for one function
    times, compile_s, fixed = {}, {}, {}
    # every variant's graph kept at once, for the interleaved rounds: the nine variants are more than
    # the 8 graphs dynamo keeps of one function by default, past which the ninth would run eager
    limit = max(torch._dynamo.config.recompile_limit, len(state))
    with torch._dynamo.config.patch(recompile_limit=limit):
        for key, (cache, start, token, _, _) in state.items():
            cache.pos = start
            fixed[key] = FixedKVCache(cache.cache)  # a view over the same RingKVCache as state's
            seconds = []
            for _ in range(DECODE_WARMUP):
                t0 = clock(device)
                compiled_step(models[key], token, fixed[key])
                seconds.append(clock(device) - t0)
            compile_s[key] = seconds[0] - seconds[-1]
            times[key] = []
        for _ in range(DECODE_ROUNDS):
            for key, (_, start, token, _, _) in state.items():
                fixed[key].pos.fill_(start)
                t0 = clock(device)
                for _ in range(n):
                    token = compiled_step(models[key], token, fixed[key]).argmax(-1, keepdim=True)
                    fixed[key].pos += 1
                times[key].append((clock(device) - t0) / n)
    return {key: (1000 * statistics.median(t), compile_s[key]) for key, t in times.items()}


def measure_peaks(preset, device, dtype):
    """The roofline's ceilings, each the best of 5 after one untimed run: the FLOP/s of an n x n x n
    matmul in dtype, and the bytes per second of summing an fp32 tensor of mib MiB, whose one add
    per element (4 bytes) leaves it bound by reading memory, as reading a decoding cache is.
    (n, mib) is the preset's peaks. On a CPU at 1 thread and at all of torch's threads."""
    n, mib = preset["peaks"]
    a, b = torch.randn(2, n, n, device=device).to(dtype)
    x = torch.ones(mib * MIB // 4, device=device)

    def best_seconds(f):
        f()
        times = []
        for _ in range(5):
            t0 = clock(device)
            f()
            times.append(clock(device) - t0)
        return min(times)

    threads = torch.get_num_threads()
    rows = []
    for t in sorted({1, threads}) if device.type == "cpu" else [threads]:
        torch.set_num_threads(t)
        rows.append(dict(threads=t, matmul=f"{n}^3 {str(dtype).removeprefix('torch.')}",
                         matmul_gflops=2 * n**3 / best_seconds(lambda: a @ b) / 1e9,
                         read_gb_per_s=x.nbytes / best_seconds(x.sum) / 1e9))
    torch.set_num_threads(threads)
    return rows


def ceilings(p):
    return (f"{p['threads']} thread{'s' * (p['threads'] > 1)}: {p['matmul']} matmul "
            f"{p['matmul_gflops']:,.0f} GFLOP/s, reading memory {p['read_gb_per_s']:.1f} GB/s")


def save(result, path):
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(path) as f:
            f.write(json.dumps(result, indent=1, allow_nan=False).encode())
    except OSError as e:  # a full disk: the last results saved stay whole
        sys.exit(f"bench.py: {path}: cannot be written: {e.strerror}")


def backend_times(ms):
    return ", ".join(f"{name} {t:.1f} ms" if isinstance(t, float) else f"{name}: {t}"
                     for name, t in ms.items())


def markdown(result):
    variants, tr, de = result["variants"], result["train"], result["decode"]
    baseline = variants.get(BASELINE, {})  # none with --only=peaks
    lines = [f"bench.py --preset={result['preset']}: {result['device']}, torch {result['torch']}, "
             f"{result['date']}"]
    if "train" in baseline:
        mode = "compiled" if tr["compile"] else "eager"
        lines += ["", f"Training: {tr['batch_size']} x {tr['seq_len']} tokens a step, {tr['dtype']}, "
                      f"Newton-Schulz in {tr['ns_dtype']}, {mode}, "
                      f"median of {tr['steps']} steps after {tr['warmup']}", "",
                  "| variant | ms/step | of which optimizer | tokens/s | MFU | x MHA |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, v in variants.items():
            t = v["train"]
            mfu = "-" if t["mfu"] is None else f"{100 * t['mfu']:.1f}%"
            lines.append(f"| {name} | {t['ms_per_step']:.1f} | {t['optimizer_ms']:.1f} | "
                         f"{t['tokens_per_s']:,.0f} | {mfu} | {t['x_mha']:.2f} |")
    if "decode" in baseline:
        lines += ["", f"Decoding: {de['dtype']}, the {de['new_tokens']} new tokens "
                      "that fill the cache up to the context, every variant in turn in each of "
                      f"{de['rounds']} rounds; ms/token: back to back, one sync, median round; a step alone: "
                      "synced before and after, median step", "",
                  "| variant | batch | context | cache | ms/token | tokens/s | ms a step alone | compiled "
                  "ms/token | x MHA compiled | compiling, s | cache MiB | % of MHA cache | x MHA time |",
                  "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, v in variants.items():
            for d in v["decode"]:
                compiled = "-" if d["compiled_ms_per_token"] is None else f"{d['compiled_ms_per_token']:.2f}"
                x_compiled = "-" if d["compiled_x_mha"] is None else f"{d['compiled_x_mha']:.2f}"
                compile_s = "-" if d["compile_s"] is None else f"{d['compile_s']:.1f}"
                storage = de["dtype"] if d["kv_quant"] == "none" else f"{d['kv_quant']}, {d['read']}"
                lines.append(f"| {name} | {d['batch_size']} | {d['context']} | {storage} | "
                             f"{d['ms_per_token']:.2f} | "
                             f"{d['tokens_per_s']:,.0f} | {d['step_alone_ms_per_token']:.2f} | {compiled} | "
                             f"{x_compiled} | {compile_s} | {d['cache_mib']:.1f} | "
                             f"{d['cache_pct_mha']:.1f} | {d['x_mha']:.2f} |")
    if "decode" in baseline and baseline.get("uncached"):
        n = de["new_tokens"]
        lines += ["", f"generate() with and without the cache: batch {de['batch_sizes'][0]}, {n} new tokens "
                      f"after {de['contexts'][0] - n}, ms per new token, prefill included, and per step "
                      f"(the {n}-token call less a 1-token call, per extra token)", "",
                  "| variant | cached | cached, per step | uncached | cache speedup |",
                  "|---|---:|---:|---:|---:|"]
        for name, v in variants.items():
            u = v["uncached"]
            lines.append(f"| {name} | {u['cached_ms_per_token']:.2f} | {u['cached_ms_per_step']:.2f} | "
                         f"{u['uncached_ms_per_token']:.2f} | {u['speedup']:.1f}x |")
    if "check" in baseline:
        lines += ["", "| variant | flash attention, forward and backward | attention in the training step | "
                      "cached vs full logits, rel. error |", "|---|---|---|---|"]
        for name, v in variants.items():
            ch, sdpa = v["check"], v.get("train", {}).get("sdpa")
            used = "-" if sdpa is None else ", ".join(sdpa["ops"]) or "math"
            verdict = "ok" if ch["decode_rel_err"] < ch["decode_tol"] else "FAIL"
            lines.append(f"| {name} | {ch['flash_error'] or 'ok'} | {used} | {ch['decode_rel_err']:.1e} "
                         f"({verdict}: tolerance {ch['decode_tol']:.0e}) |")
    for key in ("serve", "serve_long"):
        if key in result:
            lines += ["", serve.markdown(result[key])]
    if "peaks" in result:
        lines += ["", f"Ceilings (measure_peaks, best of 5): {'; '.join(map(ceilings, result['peaks']))}"]
    if "mha_sdpa_ms" in result:
        lines += ["", "MHA's forward and backward, eager, per SDPA backend: "
                      f"{backend_times(result['mha_sdpa_ms'])}"]
    return "\n".join(lines)


def variants(text):
    names = text.split(",")
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not one of {', '.join(VARIANTS)}")
    return names


def storages(text):
    """--kv_quant's value: distinct names of quant.CACHES, comma-separated."""
    names = text.split(",")
    unknown = [name for name in names if name not in CACHES]
    if unknown or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: not distinct names of {', '.join(CACHES)}, "
                                         "comma-separated")
    return names


def positive_ints(text):
    """--decode_batch's and --contexts' values: distinct positive integers, comma-separated."""
    try:
        values = [int(value) for value in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1 or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: not distinct positive integers, comma-separated")
    return values


def main(argv=None):
    parser = ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=PRESETS, default="cpu")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help=", ".join(DEVICES) + " (default: cuda where there is one, else cpu)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the training step (default: on CUDA)")
    parser.add_argument("--compiled_decode", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the compiled fixed-shape decode step (default: on CUDA, whose "
                             "kernel launches its CUDA graphs save; on a CPU its compiling, seconds to "
                             "minutes, costs more than it saves)")
    parser.add_argument("--check", action="store_true",
                        help="also check flash attention and cached decoding; on a GPU, record which "
                             "attention kernels training runs and time MHA with each SDPA backend")
    parser.add_argument("--peaks", action="store_true",
                        help="first measure a roofline's ceilings: matmul FLOP/s and memory read bandwidth")
    parser.add_argument("--only", choices=("train", "decode", "serve", "peaks"),
                        help="measure training, decoding, serving or --peaks' ceilings alone (default: "
                             "training, decoding and serving)")
    parser.add_argument("--attn", type=variants, default=list(VARIANTS),
                        help="comma-separated variants, measured in this order after MHA, which every row is "
                             "relative to (default: all)")
    parser.add_argument("--decode_batch", type=positive_ints,
                        help="comma-separated batch sizes to decode at, each at every context (default: the "
                             "preset's)")
    parser.add_argument("--contexts", type=positive_ints,
                        help="comma-separated context lengths (the positions each decoding cache holds) "
                             "(default: the preset's); the model's block_size grows to the longest")
    parser.add_argument("--random_caches", action="store_true",
                        help="decode from caches filled with random entries instead of a prefill (the "
                             "step's cost is the same; long contexts' prefills take minutes on a CPU); "
                             "leaves out generate()'s rows")
    parser.add_argument("--kv_quant", type=storages, default=["none"],
                        help="comma-separated cache storages to decode from, each a row "
                             "(lib/attention/quant.py: none, int8, int4); shares are relative to MHA's with "
                             "the first (default: none)")
    parser.add_argument("--new_tokens", type=int,
                        help="single-token steps per round and variant in decoding (default: the preset's)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="training autocast, Newton-Schulz and decoding; auto: the policy's for each")
    parser.add_argument("--shared_prefix", type=int, default=0,
                        help="serving: every request's prompt after the same this many tokens (a system "
                             "prompt, say) (default: 0)")
    parser.add_argument("--share_prefixes", action=argparse.BooleanOptionalAction, default=True,
                        help="serving: the engine shares the blocks of contexts that begin alike "
                             "(default: on)")
    parser.add_argument("--out", default="out/bench.json")
    args = parser.parse_args(argv)
    if args.shared_prefix < 0:
        parser.error(f"--shared_prefix={args.shared_prefix}: must be 0 or more tokens")
    try:
        device = pick_device(args.device)
        check_writable(args.out)  # before the measuring, not after it
        policy = {use: (getattr(torch, args.dtype), "--dtype") if args.dtype != "auto"
                  else precision(use, device) for use in USES}
    except ConfigError as e:
        parser.error(str(e))
    preset = dict(PRESETS[args.preset])
    preset["decode_batches"] = args.decode_batch or preset["decode_batches"]
    preset["contexts"] = args.contexts or preset["contexts"]
    preset["new_tokens"] = args.new_tokens or preset["new_tokens"]
    shortest = preset["new_tokens"] + DECODE_WARMUP + 1  # a prompt of at least one token before them
    if min(preset["contexts"]) < shortest:
        parser.error(f"--contexts: {min(preset['contexts'])} is too short: the preset decodes "
                     f"{preset['new_tokens']} + {DECODE_WARMUP} tokens after a prompt, so at least "
                     f"{shortest}")
    # the RoPE table has block_size rows, and no weight depends on it
    block_size = max(GPTConfig(**preset["model"]).block_size, *preset["contexts"])
    preset["model"] = {**preset["model"], "block_size": block_size}
    compile = device.type == "cuda" if args.compile is None else args.compile
    compiled_decode = device.type == "cuda" if args.compiled_decode is None else args.compiled_decode
    (dtype, _), (ns_dtype, _), (decode_dtype, _) = policy.values()
    log("precision: " + ", ".join(f"{use} {PRECISION_NAMES[d]} ({why})" for use, (d, why) in policy.items()))
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # as train.py: TF32 where autocast leaves fp32
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    result = dict(
        preset=args.preset, date=datetime.now(timezone.utc).isoformat(timespec="seconds"), device=name,
        torch=torch.__version__,
        config={k: v for k, v in asdict(GPTConfig(**preset["model"])).items() if k != "attn"},
        train=dict(batch_size=preset["batch_size"], seq_len=preset["seq_len"], warmup=preset["warmup"],
                   steps=preset["steps"], compile=compile,
                   dtype=PRECISION_NAMES[dtype] + " autocast" * (dtype == torch.bfloat16),
                   ns_dtype=PRECISION_NAMES[ns_dtype]),
        decode=dict(batch_sizes=list(preset["decode_batches"]), contexts=list(preset["contexts"]),
                    new_tokens=preset["new_tokens"], rounds=DECODE_ROUNDS, random_caches=args.random_caches,
                    kv_quant=args.kv_quant,
                    dtype=str(decode_dtype).removeprefix("torch.")),
        variants={},
    )
    if args.peaks or args.only == "peaks":
        result["peaks"] = measure_peaks(preset, device, decode_dtype)
        for p in result["peaks"]:
            log(ceilings(p))
        save(result, args.out)
    if args.check and device.type == "cuda":
        baseline = GPTConfig(attn=BASELINE, **preset["model"])
        ms = result["mha_sdpa_ms"] = sdpa_backend_ms(baseline, preset, device)
        log(f"{BASELINE}, eager, per SDPA backend: {backend_times(ms)}")
        save(result, args.out)
    for attn in dict.fromkeys((BASELINE, *args.attn)) if args.only != "peaks" else ():
        config = GPTConfig(attn=attn, **preset["model"])
        row = result["variants"][attn] = {}
        if args.check:
            row["check"] = check(config, preset, device, decode_dtype)
            ch = row["check"]
            log(f"{attn}: flash attention {ch['flash_error'] or 'ok'}; "
                f"cached vs full logits {ch['decode_rel_err']:.1e}")
        if args.only in (None, "train"):
            log(f"{attn}: training")
            row["train"] = bench_train(config, preset, device, dtype, ns_dtype, compile, profile=args.check)
            t = row["train"]
            t["x_mha"] = t["ms_per_step"] / result["variants"][BASELINE]["train"]["ms_per_step"]
            mfu = "" if t["mfu"] is None else f", MFU {100 * t['mfu']:.1f}%, {t['max_memory_gib']:.1f} GiB"
            sdpa = f", attention: {', '.join(t['sdpa']['ops']) or 'math'}" if t["sdpa"] else ""
            log(f"{attn}: {t['ms_per_step']:.1f} ms/step ({t['optimizer_ms']:.1f} optimizer), "
                f"{t['tokens_per_s']:,.0f} tokens/s{mfu}{sdpa}")
            if compile:
                torch._dynamo.reset()  # five models' graphs in one process would exhaust dynamo's caches
            if device.type == "cuda":
                torch.cuda.empty_cache()
        save(result, args.out)
    if args.only in (None, "decode"):
        log("decoding, every variant in turn")

        def measured(rows):
            for attn, decode_rows in rows.items():
                result["variants"][attn]["decode"] = decode_rows
            save(result, args.out)
        configs = {attn: GPTConfig(attn=attn, **preset["model"]) for attn in result["variants"]}
        decoded = bench_decode(configs, preset, device, decode_dtype, compiled_decode, measured,
                               args.random_caches, args.kv_quant)
        # every row against MHA's at its batch size and context, with the first storage named
        baseline = {(m["batch_size"], m["context"]): m for m in decoded[BASELINE][0]
                    if m["kv_quant"] == args.kv_quant[0]}
        for attn, (rows, uncached) in decoded.items():
            row = result["variants"][attn]
            row["decode"], row["uncached"] = rows, uncached
            for d in rows:
                m = baseline[d["batch_size"], d["context"]]
                d["cache_pct_mha"] = 100 * d["cache_mib"] / m["cache_mib"]
                d["x_mha"] = d["ms_per_token"] / m["ms_per_token"]
                d["compiled_x_mha"] = (d["compiled_ms_per_token"] / m["compiled_ms_per_token"]
                                       if d["compiled_ms_per_token"] is not None else None)
            times = [f"{d['ms_per_token']:.2f} ms/token ({d['step_alone_ms_per_token']:.2f} a step alone"
                     + (f", compiled {d['compiled_ms_per_token']:.2f} after {d['compile_s']:.1f} s compiling"
                        if d["compiled_ms_per_token"] else "")
                     + f") at {d['context']}, {d['kv_quant']} cache" for d in rows]
            speedup = f"; without the cache {uncached['speedup']:.1f}x the time" if uncached else ""
            log(f"{attn}: decoding {', '.join(times)}{speedup}")
        save(result, args.out)
    if args.only in (None, "serve"):
        # the ceilings of the steps' rooflines, measured in the same run in the serving dtype, at torch's
        # threads (the engine's)
        result["serve_peaks"] = measure_peaks(preset, device, serve.DTYPE)
        log("serving's ceilings: " + "; ".join(map(ceilings, result["serve_peaks"])))
        ceiling = result["serve_peaks"][-1]
        models = {attn: inference_model(GPTConfig(attn=attn, **preset["model"]), device, serve.DTYPE)
                  for attn in result["variants"]}
        # the preset's workload for every variant, then its decode-dominated one for the compared ones
        runs = [("serve", args.preset, models)]
        if args.preset in serve.LONG:
            runs.append(("serve_long", serve.LONG[args.preset],
                         {attn: model for attn, model in models.items() if attn in serve.COMPARED}))
        for key, name, chosen in runs:
            log(f"serving the {name} workload, every variant in turn")
            result[key] = serve.bench_serve(chosen, serve.WORKLOADS[name], device, log, ceiling,
                                            lambda: clock(device), args.shared_prefix, args.share_prefixes)
            save(result, args.out)
    print(markdown(result))
    log(f"wrote {args.out}; {time.perf_counter() - T0:.0f} s in all")


if __name__ == "__main__":
    sys.exit(run_main(main))
