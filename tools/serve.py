"""
What a smaller cache buys a server: one seeded workload of requests at one KV budget through continuous
batching (lib/attention/engine.py, over lib/attention/paged.py's paged cache) for every variant and
cache storage, and the same requests through batch-1 generate as the baseline. tools/bench.py runs it
(--only=serve, or with the rest), on the preset's workload and, where the preset has one, a
decode-dominated one beside it (LONG: long prompts, long outputs, the compared variants alone); the
figure is drawn from its JSON:

    python -m tools.bench --preset=cpu --only=serve --out=out/serve.json
    python -m tools.serve out/serve.json docs/serve_throughput.png

A row: the most sequences in flight at once, new tokens a second (the workload's, wall time), the mean
time per new token of a request after its first, the preemptions, and the cache's bytes a token (all
layers, scales included, before windows); and its mean decode step (a forward of one token a row)
against the step's roofline on the machine's ceilings measured in the same run (roofline, below). The
budget is MHA's cache in bf16 for `budget_sequences` requests of the workload's mean length. Weights and
caches are bf16 (int8, int4: their scales), as a server holds them, for the baseline too, which runs for
BATCH1's variants alone (the time of all nine would not fit bench.py --preset=cpu's). The rows of
COMPARED's variants and the baseline run ROUNDS times in turn, each its median run; the others once. The
prompts are seeded random tokens (the bench has no data): a step's cost does not depend on which tokens
it reads.
"""

import json
import statistics
import sys
import time

import torch
from matplotlib.figure import Figure
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from lib.attention.decode import ExactKVCache, generate
from lib.attention.engine import Engine
from lib.attention.layout import kv_cache_elements_per_token
from lib.attention.quant import cache_class
from lib.attention.ring import RingKVCache

# per preset: requests, their prompt and output lengths (inclusive ranges, drawn uniformly), and the
# budget in MHA sequences of the mean length. The workload is 128m's; the CPU's is scaled down
# to fit bench.py --preset=cpu in 300 s on 2 cores (docs/decoding.md), and so is its long one
WORKLOADS = {
    "128m": dict(requests=64, prompt=(16, 1024), output=(64, 256), budget_sequences=16),
    "cpu": dict(requests=48, prompt=(16, 64), output=(32, 96), budget_sequences=6),
    "long": dict(requests=12, prompt=(256, 1024), output=(128, 256), budget_sequences=4),
    "tiny": dict(requests=4, prompt=(4, 16), output=(2, 6), budget_sequences=8),
    "tiny-long": dict(requests=3, prompt=(16, 32), output=(6, 10), budget_sequences=2),
}
LONG = {"cpu": "long", "tiny": "tiny-long"}  # a preset's decode-dominated workload beside its own
STORAGES = ("none", "int8", "int4")
DTYPE = torch.bfloat16  # the weights' and the caches'
BATCH1 = ("mha",)  # the variants whose requests also go through batch-1 generate
COMPARED = ("mha", "lrkv", "mla")  # the paper's rows that docs/decoding.md compares (and LONG serves)
ROUNDS = 3  # of COMPARED's rows and of batch-1, in turn (bench_serve)


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
def bench_serve(models, spec, device, log, ceiling, clock=time.perf_counter, shared_prefix=0,
                share_prefixes=True):
    """{variant: {"serve": rows, "batch1": row or None}}: models {variant: model} in DTYPE, the first MHA
    (the budget's); ceiling: measure_peaks' row at the threads the engine runs on (tools/bench.py), for the
    rows' rooflines; clock: seconds (tools/bench.py's: CPU time at one thread); shared_prefix: the tokens
    every prompt begins with (workload), share_prefixes: the engine's."""
    vocab_size = next(iter(models.values())).config.vocab_size
    prompts, outputs = workload(spec, vocab_size, shared_prefix=shared_prefix)
    budget = budget_bytes(next(iter(models.values())), spec)

    def serve(attn, storage):
        engine = Engine(models[attn], budget, cache_class(storage), DTYPE, clock=clock,
                        share_prefixes=share_prefixes)
        engine.generate(prompts, outputs)
        s, cache = engine.stats, engine.cache
        row = dict(kv_quant=storage, budget_bytes=budget, peak_in_flight=s["peak_in_flight"],
                   tokens_per_s=s["new_tokens"] / s["seconds"], seconds=s["seconds"],
                   mean_ms_per_token=1000 * s["mean_s_per_token"], preemptions=s["preemptions"],
                   shared_tokens=s["shared_tokens"],
                   bytes_per_token=cache.block_bytes * len(cache.sources) / cache.block_size,
                   step_ms=1000 * s["decode_seconds"] / s["decode_forwards"],
                   step_rows=s["decode_rows"] / s["decode_forwards"],
                   step_positions=s["decode_positions"] / s["decode_forwards"])
        log(f"{attn}, {storage}: {row['tokens_per_s']:,.0f} tokens/s, at most {s['peak_in_flight']} in "
            f"flight, {s['preemptions']} preempted, a decode step {row['step_ms']:.2f} ms")
        return row

    # every row once a round, in turn, COMPARED's and batch-1 in every round: a machine whose speed drifts
    # (a shared CPU, by a quarter within seconds here) moves the rows compared alike
    runs, alone = {(attn, storage): [] for attn in models for storage in STORAGES}, {}
    for i in range(ROUNDS):
        for attn in models:
            if i == 0 or attn in COMPARED:
                for storage in STORAGES:
                    runs[attn, storage].append(serve(attn, storage))
            if attn in BATCH1:
                alone.setdefault(attn, []).append(batch_1(models[attn], prompts, outputs, device, clock))
                log(f"{attn}, batch-1 generate: {alone[attn][-1]['tokens_per_s']:,.0f} tokens/s")
    result = {}
    for attn, model in models.items():
        flops = step_flops(model, device)
        medians = [(median(runs[attn, storage]), len(runs[attn, storage])) for storage in STORAGES]
        rows = [dict(row, rounds=rounds, **roofline(model, row, flops, ceiling)) for row, rounds in medians]
        result[attn] = dict(serve=rows, batch1=median(alone[attn]) if attn in alone else None)
    return dict(workload=dict(spec, new_tokens=sum(outputs), prompt_tokens=sum(map(len, prompts)),
                              budget_bytes=budget, dtype=str(DTYPE).removeprefix("torch."), rounds=ROUNDS,
                              compared=[attn for attn in models if attn in COMPARED],
                              shared_prefix=shared_prefix, share_prefixes=share_prefixes, ceiling=ceiling),
                variants=result)


def median(runs):
    """The run of the median tokens a second (of an odd number; the upper middle of an even one)."""
    return sorted(runs, key=lambda row: row["tokens_per_s"])[len(runs) // 2]


# torch's counter knows SDPA's GPU kernels; a CPU's flash kernel counts the same products
CPU_SDPA_FLOPS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
                  lambda q, k, v, *args, **kwargs: flop_counter.sdpa_flop_count(q, k, v)}


def step_flops(model, device):
    """The FLOPs of one token's forward through model's exact single-token step (decode.py) after S cached
    positions, as torch's FlopCounterMode counts them (matmuls and SDPA), at two S: {"per_row": those not
    growing with S (the projections, the unembedding), "per_position": those added by each position}."""
    L = model.config.block_size
    counts = []
    for S in (L // 4, L // 2):
        cache = model.new_cache(1, S + 1, DTYPE, cache_class=RingKVCache)
        model(torch.zeros(1, S, dtype=torch.long, device=device), cache=cache)
        exact = ExactKVCache(cache)
        with FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS) as counter:
            model(torch.zeros(1, 1, dtype=torch.long, device=device), cache=exact)
        counts.append((S, counter.get_total_flops()))
    (S1, f1), (S2, f2) = counts
    per_position = (f2 - f1) / (S2 - S1)
    return dict(per_row=f1 - (S1 + 1) * per_position, per_position=per_position)


def roofline(model, row, flops, ceiling):
    """A row's mean decode step (row's step_rows rows, step_positions positions read in all) against its
    roofline, the least time the machine's ceilings allow it: the weights read once (the token
    embedding's rows aside) and every row's cache bytes at the memory bandwidth, or its FLOPs (step_flops)
    at the matmul rate, whichever is longer. A quantised cache's FLOPs are counted as the plain one's."""
    weight_bytes = sum(p.nbytes for name, p in model.named_parameters() if name != "wte.weight")
    read = weight_bytes + row["step_positions"] * row["bytes_per_token"]  # bytes
    work = row["step_rows"] * flops["per_row"] + row["step_positions"] * flops["per_position"]  # FLOPs
    memory_s, compute_s = read / (ceiling["read_gb_per_s"] * 1e9), work / (ceiling["matmul_gflops"] * 1e9)
    return dict(step_bytes=read, step_flops=work, roofline_ms=1000 * max(memory_s, compute_s),
                bound="memory" if memory_s >= compute_s else "compute",
                x_roofline=row["step_ms"] / (1000 * max(memory_s, compute_s)))


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
    c = w["ceiling"]
    lines = [f"Serving: {w['requests']} requests (prompts {w['prompt'][0]}-{w['prompt'][1]} tokens, "
             f"{w['prompt_tokens']:,} in all; outputs {w['output'][0]}-{w['output'][1]}, {w['new_tokens']:,} "
             f"in all), one KV budget of {w['budget_bytes'] / 2**20:.2f} MiB ({w['budget_sequences']} MHA "
             f"sequences of the mean length, {w['dtype']}); x MHA: against MHA's {w['dtype']} cache; "
             f"batch-1 and the rows of {', '.join(w['compared'])}: the median of {w['rounds']} runs in turn, "
             "the others one run; a decode step (one token a row) against its roofline at "
             f"{c['matmul_gflops']:,.0f} GFLOP/s and {c['read_gb_per_s']:.1f} GB/s ({c['threads']} "
             f"thread{'s' * (c['threads'] > 1)})"
             + (f"; every prompt after the same {w['shared_prefix']} tokens, blocks "
                f"{'shared' if w['share_prefixes'] else 'not shared'}" if w["shared_prefix"] else ""),
             "", "| variant | cache | bytes/token | peak in flight | x MHA | tokens/s | x MHA | x batch-1 | "
                 "ms/token | preempted | shared tokens | batch-1 tokens/s | step ms (rows) | roofline ms | "
                 "x roofline |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
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
                         + (f"{batch1:,.0f} | " if batch1 else "- | ")
                         + f"{r['step_ms']:.2f} ({r['step_rows']:.1f}) | "
                         f"{r['roofline_ms']:.2f} {r['bound']} | {r['x_roofline']:.1f} |")
    return "\n".join(lines)


def plot(result, path):
    """Tokens a second against cache bytes a token, a point per variant and storage: a panel per workload
    of result (tools/bench.py's JSON: "serve", and "serve_long" where it ran)."""
    serves = [result[key] for key in ("serve", "serve_long") if key in result]
    fig = Figure(figsize=(7 * len(serves), 4.5))
    for ax, serve in zip(fig.subplots(1, len(serves), squeeze=False)[0], serves):
        for storage, marker in zip(STORAGES, ("o", "s", "^")):
            points = [(attn, r) for attn, v in serve["variants"].items() for r in v["serve"]
                      if r["kv_quant"] == storage]
            label = serve["workload"]["dtype"] if storage == "none" else storage
            ax.scatter([r["bytes_per_token"] for _, r in points], [r["tokens_per_s"] for _, r in points],
                       marker=marker, label=label)
            for attn, r in points:
                ax.annotate(attn, (r["bytes_per_token"], r["tokens_per_s"]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        w = serve["workload"]
        ax.set_xscale("log")
        ax.set_xlabel("KV cache bytes a token (all layers)")
        ax.set_ylabel("tokens a second, continuous batching")
        ax.set_title(f"prompts {w['prompt'][0]}-{w['prompt'][1]}, outputs {w['output'][0]}-{w['output'][1]}: "
                     f"one KV budget of {w['budget_bytes'] / 2**20:.2f} MiB", fontsize=10)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tools.serve BENCH.json FIGURE.png")
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])
