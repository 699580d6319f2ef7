"""
What a smaller cache buys a server: one seeded workload of requests at one KV budget through continuous
batching (lib/attention/engine.py, over lib/attention/paged.py's paged cache) for every variant and
cache storage, and the same requests through batch-1 generate as the baseline. tools/bench.py runs it
(--only=serve, or with the rest); the figure is drawn from its JSON:

    python -m tools.bench --preset=cpu --only=serve --out=out/serve.json
    python -m tools.serve out/serve.json docs/serve_throughput.png

A row: the most sequences in flight at once, new tokens a second (the workload's, wall time), the mean
time per new token of a request after its first, the preemptions, and the cache's bytes a token (all
layers, scales included, before windows). The budget is MHA's cache in bf16 for `budget_sequences`
requests of the workload's mean length. Weights and caches are bf16 (int8, int4: their scales), as a server
holds them, for the baseline too, which runs for BATCH1's variants alone (the time of all nine would
not fit bench.py --preset=cpu's). The prompts are seeded random tokens (the bench has no data): a
step's cost does not depend on which tokens it reads.
"""

import json
import sys
import time

import torch
from matplotlib.figure import Figure

from lib.attention.decode import generate
from lib.attention.engine import Engine
from lib.attention.layout import kv_cache_elements_per_token
from lib.attention.quant import cache_class

# per preset: requests, their prompt and output lengths (inclusive ranges, drawn uniformly), and the
# budget in MHA sequences of the mean length. The workload is 128m's; the CPU's is scaled down
# to fit bench.py --preset=cpu in 240 s on 2 cores (docs/decoding.md)
WORKLOADS = {
    "128m": dict(requests=64, prompt=(16, 1024), output=(64, 256), budget_sequences=16),
    "cpu": dict(requests=48, prompt=(16, 64), output=(32, 96), budget_sequences=6),
    "tiny": dict(requests=4, prompt=(4, 16), output=(2, 6), budget_sequences=8),
}
STORAGES = ("none", "int8", "int4")
DTYPE = torch.bfloat16  # the weights' and the caches'
BATCH1 = ("mha",)  # the variants whose requests also go through batch-1 generate
ROUNDS = 3  # of batch-1 and of BATCH1's plain cache through the engine, in turn (bench_serve)


def workload(spec, vocab_size, seed=0, shared_prefix=0):
    """(prompts, outputs): the seeded requests, each prompt a list of random token ids, after the same
    shared_prefix ones (a system prompt, say) where it is not 0."""
    g = torch.Generator().manual_seed(seed)
    lengths, outputs = (torch.randint(low, high + 1, (spec["requests"],), generator=g).tolist()
                        for low, high in (spec["prompt"], spec["output"]))
    prefix = torch.randint(vocab_size, (shared_prefix,), generator=torch.Generator().manual_seed(seed + 1))
    return [prefix.tolist() + torch.randint(vocab_size, (n,), generator=g).tolist() for n in lengths], outputs


def budget_bytes(mha, spec):
    """MHA's cache in bf16 for budget_sequences requests of the workload's mean length."""
    mean = (sum(spec["prompt"]) + sum(spec["output"])) / 2
    per_token = kv_cache_elements_per_token(mha) * DTYPE.itemsize
    return int(spec["budget_sequences"] * mean * per_token)


@torch.inference_mode()
def bench_serve(models, spec, device, log, clock=time.perf_counter, shared_prefix=0, share_prefixes=True):
    """{variant: {"serve": rows, "batch1": row or None}}: models {variant: model} in DTYPE, the first MHA
    (the budget's); clock: seconds (tools/bench.py's: CPU time at one thread); shared_prefix: the tokens
    every prompt begins with (workload), share_prefixes: the engine's."""
    vocab_size = next(iter(models.values())).config.vocab_size
    prompts, outputs = workload(spec, vocab_size, shared_prefix=shared_prefix)
    budget = budget_bytes(next(iter(models.values())), spec)
    result = {}
    for attn, model in models.items():
        def serve(storage):
            engine = Engine(model, budget, cache_class(storage), DTYPE, clock=clock,
                            share_prefixes=share_prefixes)
            engine.generate(prompts, outputs)
            s, cache = engine.stats, engine.cache
            row = dict(kv_quant=storage, budget_bytes=budget, peak_in_flight=s["peak_in_flight"],
                       tokens_per_s=s["new_tokens"] / s["seconds"], seconds=s["seconds"],
                       mean_ms_per_token=1000 * s["mean_s_per_token"], preemptions=s["preemptions"],
                       shared_tokens=s["shared_tokens"],
                       bytes_per_token=cache.block_bytes * len(cache.sources) / cache.block_size)
            log(f"{attn}, {storage}: {row['tokens_per_s']:,.0f} tokens/s, at most "
                f"{s['peak_in_flight']} in flight, {s['preemptions']} preempted")
            return row
        rows, batch1 = [serve(storage) for storage in STORAGES], None
        if attn in BATCH1:
            # batch-1 and the plain cache's engine in turn, ROUNDS times, each its median round: a machine
            # whose speed drifts (a shared CPU, by a quarter within seconds here) moves the two alike
            plain, alone = [rows[0]], []
            for i in range(ROUNDS):
                alone.append(batch_1(model, prompts, outputs, device, clock))
                log(f"{attn}, batch-1 generate: {alone[-1]['tokens_per_s']:,.0f} tokens/s")
                plain += [serve("none")] if i < ROUNDS - 1 else []
            rows[0], batch1 = (sorted(runs, key=lambda row: row["tokens_per_s"])[ROUNDS // 2]
                               for runs in (plain, alone))
        result[attn] = dict(serve=rows, batch1=batch1)
    return dict(workload=dict(spec, new_tokens=sum(outputs), prompt_tokens=sum(map(len, prompts)),
                              budget_bytes=budget, dtype=str(DTYPE).removeprefix("torch."), rounds=ROUNDS,
                              shared_prefix=shared_prefix, share_prefixes=share_prefixes),
                variants=result)


def batch_1(model, prompts, outputs, device, clock):
    """The requests one after another through decode.generate (a cache of its own each, the plain cached
    path, as the engine's)."""
    t0 = clock()
    for prompt, n in zip(prompts, outputs):
        generate(model, torch.tensor([prompt], device=device), n, temperature=0, cache_dtype=DTYPE)
    seconds = clock() - t0
    return dict(tokens_per_s=sum(outputs) / seconds, seconds=seconds,
                mean_ms_per_token=1000 * seconds / sum(outputs))


def markdown(serve):
    w, variants = serve["workload"], serve["variants"]
    mha = variants[next(iter(variants))]
    lines = [f"Serving: {w['requests']} requests (prompts {w['prompt'][0]}-{w['prompt'][1]} tokens, "
             f"{w['prompt_tokens']:,} in all; outputs {w['output'][0]}-{w['output'][1]}, {w['new_tokens']:,} "
             f"in all), one KV budget of {w['budget_bytes'] / 2**20:.2f} MiB ({w['budget_sequences']} MHA "
             f"sequences of the mean length, {w['dtype']}); x MHA: against MHA's {w['dtype']} cache; "
             f"batch-1 and the {w['dtype']} rows of {', '.join(BATCH1)}: the median of {w['rounds']} runs in "
             "turn"
             + (f"; every prompt after the same {w['shared_prefix']} tokens, blocks "
                f"{'shared' if w['share_prefixes'] else 'not shared'}" if w["shared_prefix"] else ""),
             "", "| variant | cache | bytes/token | peak in flight | x MHA | tokens/s | x MHA | x batch-1 | "
                 "ms/token | preempted | shared tokens | batch-1 tokens/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = mha["serve"][0]
    for attn, v in variants.items():
        batch1 = v["batch1"]["tokens_per_s"] if v["batch1"] else None
        for r in v["serve"]:
            storage = w["dtype"] if r["kv_quant"] == "none" else r["kv_quant"]
            lines.append(f"| {attn} | {storage} | {r['bytes_per_token']:,.0f} | {r['peak_in_flight']} | "
                         f"{r['peak_in_flight'] / base['peak_in_flight']:.2f} | {r['tokens_per_s']:,.0f} | "
                         f"{r['tokens_per_s'] / base['tokens_per_s']:.2f} | "
                         + (f"{r['tokens_per_s'] / batch1:.1f} | " if batch1 else "- | ")
                         + f"{r['mean_ms_per_token']:.1f} | {r['preemptions']} | {r['shared_tokens']:,} | "
                         + (f"{batch1:,.0f} |" if batch1 else "- |"))
    return "\n".join(lines)


def plot(serve, path):
    """Tokens a second against cache bytes a token, a point per variant and storage."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for storage, marker in zip(STORAGES, ("o", "s", "^")):
        points = [(attn, r) for attn, v in serve["variants"].items() for r in v["serve"]
                  if r["kv_quant"] == storage]
        label = serve["workload"]["dtype"] if storage == "none" else storage
        ax.scatter([r["bytes_per_token"] for _, r in points], [r["tokens_per_s"] for _, r in points],
                   marker=marker, label=label)
        for attn, r in points:
            ax.annotate(attn, (r["bytes_per_token"], r["tokens_per_s"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("KV cache bytes a token (all layers)")
    ax.set_ylabel("tokens a second, continuous batching")
    ax.set_title(f"One KV budget of {serve['workload']['budget_bytes'] / 2**20:.2f} MiB", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tools.serve BENCH.json FIGURE.png")
    with open(sys.argv[1]) as f:
        plot(json.load(f)["serve"], sys.argv[2])
