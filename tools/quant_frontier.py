"""
The cache-against-quality frontier of the KV cache's storage: for each checkpoint, the cache in fp32,
bf16, int8 and int4 (lib/attention/quant.py), each's bytes per token at the model's context (scales
included, model.kv_cache_bytes), and with each the validation loss and bits per byte teacher-forced
through the cache (decode.teacher_forced: a token at a time, each through its variant's exact step,
as decoding sees the cache), the greedy text's first departure from fp32's, and a figure of loss
against cache bytes, every run's points joined. The downstream tasks with each storage are eval.py
--kv_quant's (make demo-quant runs both).

    python -m tools.quant_frontier out/demo --out_dir=out/demo      # every out/demo/*/ckpt.pt
"""

import json
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from matplotlib.figure import Figure

from lib.attention.decode import exact_step, generate, teacher_forced
from lib.attention.quant import Int4KVCache, Int8KVCache
from lib.attention.ring import RingKVCache
from lib.evaluation.runs import legend_labels, provenance, run_order
from lib.training.checkpoint import check_writable, load_checkpoint
from lib.training.configurator import ArgumentParser, ConfigError, positive_int, run_main
from lib.training.data import atomic_open, load_data, load_tokenizer, write_atomic
from lib.training.hardware import check_environment
from lib.training.recipe import TrainConfig, evaluate

# (name, cache class, cache dtype): the storages compared, the weights in fp32 throughout
STORAGES = [("fp32", RingKVCache, torch.float32), ("bf16", RingKVCache, torch.bfloat16),
            ("int8", Int8KVCache, torch.bfloat16), ("int4", Int4KVCache, torch.bfloat16)]
GREEDY_TOKENS = 100


def validation(model, val_tokens, bytes_per_token, cache_class, dtype, batch_size):
    """(nats per token, bits per byte) on val_tokens' consecutive block_size windows, train.py's evaluate
    (recipe.evaluate) with each window's logits teacher-forced through a cache of cache_class in dtype."""
    def through_the_cache(idx):
        return teacher_forced(model, idx, cache_class, dtype), None
    return evaluate(through_the_cache, val_tokens, bytes_per_token, model.config.block_size, batch_size,
                    nullcontext(), 0, 1)


def load(path):
    """(ckpt, model, val_tokens, bytes_per_token, tokenizer) of a checkpoint, its validation slice as train.py
    reads it, or a ConfigError of one line."""
    ckpt, model = load_checkpoint(path, "cpu", needs=("config", "tokenizer"))
    _, _, val_tokens, bytes_per_token = load_data(TrainConfig(**ckpt["config"]), model.config)
    return ckpt, model.eval(), val_tokens, bytes_per_token, load_tokenizer(path, ckpt)


@torch.no_grad()
def frontier(path, ckpt, model, val_tokens, bytes_per_token, tok, batch_size):
    """One checkpoint's run: its storages' bytes per token, validation and greedy departure."""
    config, T = model.config, model.config.block_size
    prompt = torch.tensor([[tok.eot_id, *tok.encode_batch(["def "])[0].tolist()]])  # a document's start
    storages, greedy = {}, {}
    for name, cache_class, dtype in STORAGES:
        loss, bpb = validation(model, val_tokens, bytes_per_token, cache_class, dtype, batch_size)
        tokens = generate(model, prompt, GREEDY_TOKENS, temperature=0, step=exact_step,
                          vocab_size=tok.vocab_size, cache_class=cache_class, cache_dtype=dtype)
        greedy[name] = tokens[0, prompt.size(1):]
        differ = (greedy[name] != greedy["fp32"]).nonzero()
        departs = int(differ[0]) if len(differ) else None
        storages[name] = dict(bytes_per_token=model.kv_cache_bytes(1, T, dtype, cache_class) / T,
                              val_loss=loss, val_bpb=bpb, greedy_departs_at=departs)
        print(f"{path}: {name}: {storages[name]['bytes_per_token']:,.1f} bytes a token, val loss {loss:.4f}, "
              f"bpb {bpb:.4f}, greedy tokens from fp32's from token "
              f"{departs if departs is not None else f'- (none of {GREEDY_TOKENS})'}", flush=True)
    return config, dict(ckpt=str(path), **provenance(ckpt, config), attn=config.attn, n_layer=config.n_layer,
                        context=T, storages=storages)


def plot(runs):
    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.subplots()
    for run in runs:
        xs = [s["bytes_per_token"] for s in run["storages"].values()]
        ys = [s["val_loss"] for s in run["storages"].values()]
        ax.plot(xs, ys, marker="o", markersize=4, label=run["label"])
        for (name, s) in run["storages"].items():
            ax.annotate(name, (s["bytes_per_token"], s["val_loss"]), fontsize=6, textcoords="offset points",
                        xytext=(3, 3))
    ax.set_xscale("log")
    ax.set_xlabel("KV cache bytes per token at the context (all layers, scales included)")
    ax.set_ylabel("validation loss through the cache (nats per token)")
    ax.set_title("Loss against cache bytes: each run in fp32, bf16, int8 and int4")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def markdown(runs):
    lines = ["| run | " + " | ".join(f"{name}: bytes/token, loss, bpb" for name, _, _ in STORAGES) + " |",
             "|---|" + "---|" * len(STORAGES)]
    for run in runs:
        cells = [f"{s['bytes_per_token']:,.0f}, {s['val_loss']:.4f}, {s['val_bpb']:.4f}"
                 for s in run["storages"].values()]
        lines.append(f"| {run['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = ArgumentParser(prog="tools/quant_frontier.py", description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("ckpts", nargs="+", help="checkpoints, or folders holding */ckpt.pt")
    parser.add_argument("--out_dir", type=Path, required=True, help="quant_frontier.json and .png go here")
    parser.add_argument("--batch_size", type=positive_int, default=128, help="windows decoded at once")
    args = parser.parse_args(argv)
    try:
        check_environment()
        check_writable(args.out_dir / "quant_frontier.json")
        paths = []
        for name in map(Path, args.ckpts):
            found = sorted(name.glob("*/ckpt.pt")) if name.is_dir() else [name]
            if not found:
                raise ConfigError(f"{name}: a folder with no */ckpt.pt in it")
            paths += found
        loaded = {path: load(path) for path in paths}  # each that does not load, one line before any runs
    except ConfigError as e:
        print(f"tools/quant_frontier.py: {e}", file=sys.stderr)
        return 2
    analysed = sorted((frontier(path, *loaded[path], args.batch_size) for path in paths),
                      key=lambda cr: run_order(*cr))
    configs, runs = zip(*analysed)
    for run, label in zip(runs, legend_labels(configs, runs)):
        run["label"] = label
    print()
    print(markdown(runs))
    results = json.dumps(dict(runs=runs, greedy_tokens=GREEDY_TOKENS), indent=1) + "\n"
    write_atomic(args.out_dir / "quant_frontier.json", results.encode())
    with atomic_open(args.out_dir / "quant_frontier.png") as f:
        plot(runs).savefig(f, format="png", dpi=150)
    print(f"wrote {args.out_dir / 'quant_frontier.json'} and quant_frontier.png")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
