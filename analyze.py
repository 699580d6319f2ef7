"""
Head diversity from the weights alone: the paper's two figures (section 4) and its KV-cache
Pareto view, for one or more checkpoints written by train.py. The math (the heads' similarity
matrix G and its effective rank) is diversity.py's.

$ python analyze.py out/*/ckpt.pt           # or a folder holding */ckpt.pt: python analyze.py out
$ python analyze.py out/mha/ckpt.pt --layer mean --centered --out_dir figures

Writes effective_rank.png, head_correlation.png, kv_tradeoff.png, kv_cache.png (what each run
caches per token), loss_curves.png and rank_during_training.png (from each run's log.jsonl beside
its checkpoint: the losses, and the effective ranks train.py logs at every evaluation),
tasks_during_training.png (where train.py --eval_tasks logged downstream scores),
rank_energy.png (for an MHA checkpoint: how much rank its heads' keys and values need, from the
weights alone and, where its training data is there, as the inputs of its attention see them)
and analysis.json, and prints a table. Runs started
from another checkpoint (train.py --init_from) are told apart and show where they started, and
a conversion calibrated on the inputs (--calibration_tokens) is labelled "whitened", an
uptraining with a KL term to the source (--distill) "distilled".
Everything runs on the CPU in float64, but for the MHA model's forward pass over its training
data (fp32), which gives rank_energy.png's inputs.
"""

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from lib.training.checkpoint import check_writable, load_checkpoint, read_log
from lib.training.configurator import ArgumentParser, ConfigError, run_main
from lib.training.hardware import check_environment
from lib.attention.convert import CALIBRATION_TOKENS, attention_input_covariances, shared_plus_low_rank
from lib.attention.diversity import layer_ranks, no_head_maps, similarities
from lib.attention.heads import head_kv_weights
from lib.attention.layout import key_layers, kv_cache_elements_per_token, kv_source, layer_window
from lib.evaluation.runs import layout, legend_labels, provenance, run_order
from lib.training.data import TrainBatches, atomic_open, read_shard, shard_paths, write_atomic


def fail(path, problem):
    sys.exit(f"{path}: {problem}")


def rank_energy(model, covariances=None):
    """Per layer, for keys and for values: the share of the heads' deviation from their mean,
    sum_h ||W_h - W_shared||_F^2, that a rank-r residual per head keeps, for r = 1..d_h: the
    energy LRKV's conversion from these heads keeps (shared_plus_low_rank; by Eckart-Young no
    rank-r residuals keep more). With covariances, per layer the C of its attention's inputs, the
    deviation as those inputs see it, sum_h ||(W_h - W_shared) C^(1/2)||_F^2: what the whitened
    conversion keeps. None for a variant with no per-head projections or no spread."""
    try:
        per_layer = [head_kv_weights(model.blocks[i].attn) for i in key_layers(model)]
    except ValueError:
        return None
    energy = {"keys": [], "values": []}
    for (W_K, W_V), C in zip(per_layer, covariances or [None] * len(per_layer)):
        for name, W in (("keys", W_K), ("values", W_V)):
            S = shared_plus_low_rank(W, 0, C)[3]  # (H, d_h): of each W_h - W_shared [times C^(1/2)]
            by_rank = S.pow(2).sum(0)  # (d_h,): what the heads' i-th singular directions hold together
            if by_rank.sum() == 0:
                return None
            energy[name].append((by_rank.cumsum(0) / by_rank.sum()).tolist())
    return energy


def seen_rank_energy(path):
    """rank_energy of the checkpoint's heads as its attention's inputs see them, calibrated as
    train.py --init_from calibrates a conversion from it by default: CALIBRATION_TOKENS tokens of
    its data_dir's train split, drawn for its seed. (None, why) where that data is not there, else
    (energy, None)."""
    ckpt, model = load_checkpoint(path, "cpu")
    config = ckpt.get("config", {})
    if "data_dir" not in config:
        return None, "the checkpoint names no data_dir"
    try:
        shards = [read_shard(shard) for shard in shard_paths(config["data_dir"], "train")]
    except (OSError, ValueError) as e:
        return None, str(e)
    batches = TrainBatches(shards, model.config.block_size)
    # 8 windows at a time: the 128M model's activations for 8 x 2048 tokens fit a CPU's memory
    covariances = attention_input_covariances(model, batches, CALIBRATION_TOKENS,
                                              config.get("seed", 0), 8, "cpu")
    return rank_energy(model.double(), covariances), None


def loss_curves(records, ckpt):
    """The training and validation losses that train.py logged beside the checkpoint (records),
    against tokens seen: {"train": [[tokens, loss], ...], "val": [...]}, or None without a log."""
    if not records or "config" not in ckpt:
        return None
    tokens_per_step = ckpt["config"]["batch_size"] * ckpt["model_args"]["block_size"]
    curves = {"train": [], "val": []}
    for record in records:
        kind, key = ("val", "val_loss") if "val_loss" in record else ("train", "loss")
        curves[kind].append([record["step"] * tokens_per_step, record[key]])
    return curves


def ranks_during_training(records):
    """The effective ranks train.py logged beside the checkpoint (records), at each evaluation:
    {"step": [...], "effective_rank": [per layer, ...], "effective_rank_centered": [...]}, or None
    for a log from before train.py logged them, none, or a variant with no rank (logged as None)."""
    logged = [record for record in records if record.get("effective_rank") is not None]
    if not logged:
        return None
    keys = ("step", "effective_rank", "effective_rank_centered")
    return {key: [record[key] for record in logged] for key in keys}


def tasks_during_training(records):
    """The downstream scores train.py --eval_tasks logged beside the checkpoint (records), at each
    evaluation that has them: {name: {"metric", "chance", "step": [...], "value": [...]}}, or None."""
    tasks = {}
    for record in records:
        for name, score in record.get("tasks", {}).items():
            task = tasks.setdefault(name, {"metric": score["metric"], "chance": score.get("chance"),
                                           "step": [], "value": []})
            task["step"].append(record["step"])
            task["value"].append(score["value"])
    return tasks or None


def analyze(path):
    """The checkpoint's config, and what analysis.json records of it apart from its label."""
    try:
        ckpt, model = load_checkpoint(path)
        records = read_log(Path(path).parent)
    except ConfigError as e:  # one line that names the checkpoint or its log
        sys.exit(str(e))
    config = model.config
    # LRKV's W_shared + U_h B_h^T and MLA's W_down W_up,h are composed in float64 as well; only
    # the attention weights are converted, the rest of the model is never read
    for block in model.blocks:
        block.attn.double()
    similarity = similarities(model)  # None, and so are the ranks, where the heads give no maps of x
    missing = no_head_maps(model)
    if missing:
        print(f"{path}: {missing}: the rank figures and analysis.json say so", file=sys.stderr)
    kv_elements = kv_cache_elements_per_token(model)
    # the cache of one sequence at the model's context L, in bf16, against MHA's: windows keep less
    L = config.block_size
    kv_bytes = model.kv_cache_bytes(1, L, torch.bfloat16)
    mha_bytes = config.n_layer * 2 * config.n_embd * L * 2
    cached = {}  # {name: elements per token, all layers}, from the buffers decoding allocates
    for i in key_layers(model):
        for name, shape in model.blocks[i].attn.cache_shapes().items():
            cached[name] = cached.get(name, 0) + math.prod(shape)
    validation = {key: None if ckpt.get(key) is None else float(ckpt[key]) for key in ("val_loss", "val_bpb")}
    return config, {
        "ckpt": str(path),
        "attn": config.attn,
        "n_layer": config.n_layer,
        "cla": config.cla,
        "kv_sources": [kv_source(config, layer) for layer in range(config.n_layer)],  # whose keys each reads
        "windows": [layer_window(config, layer) for layer in range(config.n_layer)],  # None: all positions
        "layout": layout(config),
        # the layers whose keys the ranks are of: those that own keys, whose keys the others share
        "key_layers": key_layers(model),
        "n_head": config.n_head,
        "n_params": model.get_num_params(),
        "kv_cache_elements_per_token": kv_elements,  # all layers'
        "kv_cache_entries": cached,
        "context": L,
        "kv_cache_bytes": kv_bytes,  # one sequence of L tokens, bf16
        "kv_cache_fraction": kv_bytes / mha_bytes,  # of MHA's at L
        **validation,
        "curves": loss_curves(records, ckpt),
        **provenance(ckpt, config),
        # a run from --init_from evaluates the converted model at step 0, before any update
        "start": next(({k: r[k] for k in ("val_loss", "val_bpb")} for r in records
                       if r["step"] == 0 and "val_loss" in r), None),
        "rank_energy": rank_energy(model),
        "no_head_maps": missing,  # why there are no ranks, or None
        **layer_ranks(similarity),
        "ranks_during_training": ranks_during_training(records),
        "tasks_during_training": tasks_during_training(records),
        "similarity": None if similarity is None else [G.tolist() for G in similarity],
    }


def colors(labels):
    """matplotlib's colour cycle in legend order (the paper's colours), a converted run taking the
    colour of the run from scratch with its label where there is one."""
    bases = list(dict.fromkeys(label.split(", ")[0] for label in labels))
    return [f"C{bases.index(label.split(', ')[0]) % 10}" for label in labels]


def line_style(run):
    """Runs converted alike share a colour: whitened ones are drawn dashed, distilled ones dotted."""
    return ":" if run["distilled"] else "--" if run["whitened"] else "-"


def model_size(n_params):
    """All parameters, both untied embeddings included (GPT.get_num_params, as train.py reports
    them), to the nearest million, or tenth of a million below 10M (the demo's 0.5M): the paper's
    "128M" configuration reads 162M by this rule (124M without the unembedding; the paper does not
    say how it counts, and no rule gives 128M)."""
    if n_params >= 1e9:
        return f"{n_params / 1e9:.1f}B"
    return f"{n_params / 1e6:.0f}M" if n_params >= 1e7 else f"{n_params / 1e6:.1f}M"


def no_rank_notes(ax, runs):
    """An entry in ax's legend, with no line, for each run whose heads give no maps of x (no rank)."""
    for run in runs:
        if run["no_head_maps"]:
            ax.plot([], [], linestyle="none", label=f"{run['label']}: no maps of x, no rank")


def plot_effective_rank(runs, centered):
    """One line per checkpoint over the layers, a note in the legend for each whose heads give no
    maps of x; the size in the title is the first run's, MHA's where there is one. None if no run
    has ranks."""
    key = "effective_rank_centered" if centered else "effective_rank"
    ranked = [run for run in runs if run[key] is not None]
    if not ranked:
        return None
    # identical heads score 1 (centred: 0), mutually orthogonal ones H (centred: H - 1)
    H = max(run["n_head"] for run in ranked)
    redundant, top = (0, H - 1) if centered else (1, H)
    fig = Figure(figsize=(7.5, 4), layout="constrained")
    ax = fig.subplots()
    for run in ranked:  # a run that shares keys has the ranks of the layers that own them alone
        ax.plot(run["key_layers"], run[key], marker="o", markersize=4, color=run["color"],
                linestyle=line_style(run), label=run["label"])
    no_rank_notes(ax, runs)
    shared = any(len(run["key_layers"]) < run["n_layer"] for run in ranked)
    ax.axhline(redundant, color="gray", linestyle="--", label="Fully redundant")
    ax.set_ylim(redundant - 0.2, top + 0.2)
    ax.set_yticks(range(redundant, top + 1))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.set_xlabel("Layer" + (" (points: the layers that own keys, which the others read)" if shared else ""))
    ax.set_ylabel("PCA-based effective rank" if centered else "Effective rank")
    kind = "PCA-based Effective Rank" if centered else "Effective Rank"
    ax.set_title(f"Head Diversity via {kind} ({model_size(runs[0]['n_params'])})")
    fig.legend(loc="outside right upper")
    return fig


def plot_rank_during_training(runs, centered):
    """Effective rank against the training step, one line per run whose log holds it, in three
    panels: the mean over the layers, the first layer and the last (with keys of its own, in CLA).
    When the heads collapse, and
    whether they recover, shows here, where the final checkpoint's figure shows only where they
    ended. The y axis fits the lines (at 12 layers on a CPU they move by hundredths of H); the
    dashed line is H (centred: H - 1), mutually orthogonal heads; a run whose heads give no maps of x
    is a note in the legend. None if no run's log holds ranks."""
    logged = [run for run in runs if run["ranks_during_training"]]
    if not logged:
        return None
    key = "effective_rank_centered" if centered else "effective_rank"
    lasts = {run["key_layers"][-1] for run in logged}
    last = f"Last layer ({lasts.pop()})" if len(lasts) == 1 else "Last layer with keys"
    fig = Figure(figsize=(13, 3.8), layout="constrained")
    axes = fig.subplots(1, 3, sharey=True)
    for ax, (title, pick) in zip(axes, (("Mean over layers", lambda ranks: ranks.mean(1)),
                                        ("First layer (0)", lambda ranks: ranks[:, 0]),
                                        (last, lambda ranks: ranks[:, -1]))):
        for run in logged:
            during = run["ranks_during_training"]
            ax.plot(during["step"], pick(np.array(during[key])), marker="o", markersize=3, color=run["color"],
                    linestyle=line_style(run), label=run["label"])
        ax.axhline(max(run["n_head"] for run in logged) - centered, color="gray", linestyle="--")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.set_title(title)
        ax.set_xlabel("Training step")
    axes[0].set_ylabel("PCA-based effective rank" if centered else "Effective rank")
    no_rank_notes(axes[0], runs)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper")
    fig.suptitle(f"Head Diversity During Training ({model_size(logged[0]['n_params'])})")
    return fig


def plot_tasks_during_training(runs):
    """Each downstream task's metric against the training step (train.py --eval_tasks), a panel a
    task, a line per run that logged it, the chance level dashed: the downstream view of the loss
    curves and of rank_during_training.png."""
    names = list(dict.fromkeys(name for run in runs for name in run["tasks_during_training"] or {}))
    fig = Figure(figsize=(4.3 * len(names) + 2.5, 3.8), layout="constrained")
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, name in zip(axes, names):
        for run in runs:
            task = (run["tasks_during_training"] or {}).get(name)
            if task:
                ax.plot(task["step"], task["value"], marker="o", markersize=3, color=run["color"],
                        linestyle=line_style(run), label=run["label"])
                metric, chance = task["metric"], task["chance"]
        if chance is not None:
            ax.axhline(chance, color="gray", linestyle="--", label="chance")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.set_title(name)
        ax.set_xlabel("Training step")
        ax.set_ylabel("bits per byte (lower is better)" if metric == "bpb" else f"accuracy ({metric})")
    handles = {label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="outside right upper")
    fig.suptitle("Downstream Tasks During Training")
    return fig


def most_different_layer(runs):
    """The layer whose effective ranks differ most between the runs (largest max - min), where
    the variants' heads tell them apart, of those that own keys in every run with ranks; None if
    fewer than two runs have ranks, they differ in depth or no layer owns keys in all of them."""
    runs = [run for run in runs if run["effective_rank"] is not None]
    if len(runs) < 2 or len({run["n_layer"] for run in runs}) > 1:
        return None
    common = sorted(set.intersection(*(set(run["key_layers"]) for run in runs)))
    if not common:
        return None
    ranks = np.array([[run["effective_rank"][run["key_layers"].index(layer)] for layer in common]
                      for run in runs])  # (runs, layers)
    return common[int((ranks.max(0) - ranks.min(0)).argmax())]


def key_layer(run, layer):
    """The layer whose keys layer attends with in run: itself, or the layer it shares them with."""
    return run["kv_sources"][layer % run["n_layer"]]


def plot_head_correlation(runs, layer):
    """One H x H panel of G per checkpoint, for layer `layer`: an index (in CLA the G of the group's
    first layer, whose keys it attends with), "mean" (of the layers' matrices), or None for the layer
    where the runs differ most (most_different_layer). A run whose heads give no maps of x has a panel
    that says so; None if no run has a G."""
    if all(run["similarity"] is None for run in runs):
        return None
    similarity = [None if run["similarity"] is None else np.array(run["similarity"]) for run in runs]
    if layer == "mean":
        panels, which = [None if s is None else s.mean(0) for s in similarity], "mean over layers"
    else:
        index = most_different_layer(runs) if layer is None else None
        shown = ([key_layer(run, index) for run in runs] if index is not None else
                 [key_layer(run, run["n_layer"] // 2 if layer is None else layer) for run in runs])
        panels = [None if s is None else s[run["key_layers"].index(i)]
                  for s, run, i in zip(similarity, runs, shown)]
        drawn = sorted({i for i, s in zip(shown, similarity) if s is not None})
        which = ("layer " + ", ".join(map(str, drawn))
                 + (", where the runs' effective ranks differ most" if index is not None else ""))
    fig = Figure(figsize=(2.3 * len(runs) + 1, 3), layout="constrained")
    axes = fig.subplots(1, len(runs), squeeze=False)[0]
    for ax, run, G in zip(axes, runs, panels):
        ax.set_title(run["label"], fontsize=10)
        if G is None:
            ax.text(0.5, 0.5, "no maps of x", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        image = ax.imshow(G, cmap="RdBu_r", vmin=-1, vmax=1)
        ax.set_xlabel("Head Index")
        ax.set_ylabel("Head Index")
        ax.set_xticks(range(run["n_head"]))
        ax.set_yticks(range(run["n_head"]))
    # pad is a fraction of the whole row: a tenth of one panel keeps the colour bar beside the last
    fig.colorbar(image, ax=axes, pad=0.1 / len(runs), label="Similarity")
    fig.suptitle(f"Attention Head Correlation ({which})")
    return fig


def pareto_front(points):
    """The (x, y) points that no other point matches or beats on both, left to right."""
    return sorted(p for p in points if not any(q != p and q[0] <= p[0] and q[1] <= p[1] for q in points))


def plot_kv_tradeoff(runs):
    """Validation loss and BPB against the KV cache of one sequence at the model's context, as % of
    MHA's (windows keep less there; without windows, what a token caches), one point per checkpoint
    with validation numbers, and their Pareto front; a converted run (diamond; whitened a square,
    distilled a triangle) also where it started (hollow), before uptraining.
    None if no checkpoint carries validation numbers."""
    metrics = [("val_loss", "Validation loss (nats/token)"), ("val_bpb", "Validation bits per byte")]
    metrics = [(key, name) for key, name in metrics if any(run[key] is not None for run in runs)]
    if not metrics:
        return None
    # tall enough for the legend's line a run, and the Pareto front's (make convert has 20)
    fig = Figure(figsize=(4 * len(metrics) + 2, max(3.6, 0.27 * (len(runs) + 2))), layout="constrained")
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    for ax, (key, name) in zip(axes, metrics):
        points = [(100 * run["kv_cache_fraction"], run[key], i) for i, run in enumerate(runs)
                  if run[key] is not None]
        for x, y, i in points:
            run = runs[i]
            marker = "^" if run["distilled"] else "s" if run["whitened"] else "D" if run["init_from"] else "o"
            ax.scatter(x, y, color=run["color"], marker=marker, label=run["label"], zorder=3)
            if run["start"] is not None:  # where a converted run began, before uptraining
                ax.scatter(x, run["start"][key], facecolors="none", edgecolors=run["color"], marker=marker,
                           zorder=3)
                ax.plot([x, x], [run["start"][key], y], color=run["color"], linestyle=":", zorder=2)
        front = pareto_front([(x, y) for x, y, _ in points])
        ax.plot(*zip(*front), color="gray", linestyle="--", zorder=2, label="Pareto front")
        ax.grid(alpha=0.3)
        ax.set_xlabel("KV cache at the context (% of MHA)")
        ax.set_ylabel(name)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper")
    fig.suptitle("Validation Loss vs KV Cache Size")
    return fig


def plot_kv_cache(runs):
    """What each run caches per token and layer (its mean over the layers): a bar per run, a
    segment per entry of its cache_shapes (k and v; LRKV's k_shared, r_k, rho, v_shared, r_v;
    MLA's c, k_rope, rho), each entry's colour the same in every bar."""
    names = list(dict.fromkeys(name for run in runs for name in run["kv_cache_entries"]))
    fig = Figure(figsize=(9, 0.5 * len(runs) + 1.4), layout="constrained")
    ax = fig.subplots()
    for row, run in enumerate(runs):
        left = 0
        for name, elements in run["kv_cache_entries"].items():
            width = elements / run["n_layer"]
            ax.barh(row, width, left=left, color=f"C{names.index(name) % 10}", edgecolor="white")
            ax.text(left + width / 2, row, name, ha="center", va="center", fontsize=7)
            left += width
        ax.text(left, row, f" {left:g}", va="center", fontsize=8)
    ax.set_yticks(range(len(runs)), [run["label"] for run in runs])
    ax.invert_yaxis()
    ax.set_xlabel("Cached elements per token and layer")
    ax.set_title("What Each Variant Caches")
    ax.grid(axis="x", alpha=0.3)
    return fig


def plot_loss_curves(runs):
    """Validation and training loss against tokens seen, one line per run with a log; None if
    no run has one. The paper's claim about loss is about this curve: LRKV reaches a baseline's
    final loss in fewer tokens."""
    if not any(run["curves"] for run in runs):
        return None
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, kind, name in zip(axes, ("val", "train"), ("Validation loss", "Training loss")):
        for run in runs:
            if run["curves"] and run["curves"][kind]:
                tokens, loss = zip(*run["curves"][kind])
                ax.plot(np.array(tokens) / 1e6, loss, color=run["color"], label=run["label"],
                        linestyle=line_style(run), marker="o" if kind == "val" else None, markersize=3)
        ax.grid(alpha=0.3)
        ax.set_xlabel("Tokens (millions)")
        ax.set_ylabel(f"{name} (nats/token)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper")
    fig.suptitle("Loss vs Tokens")
    return fig


def plot_rank_energy(run, head_dim):
    """run's rank_energy: per layer, the share of its heads' key (left) and value (right)
    deviation from their mean that a rank-r residual per head keeps, with the paper's ranks
    (r = 16, 46 and 64 of d_h = 128) marked where they fall at this head dim; below it, where
    the run has one, its rank_energy_seen, the same share as its attention's inputs see it."""
    spectra = [(key, what) for key, what in (("rank_energy", "sum_h ||W_h - mean||_F^2"),
                                             ("rank_energy_seen", "sum_h ||(W_h - mean) C^(1/2)||_F^2"))
               if run.get(key)]
    fig = Figure(figsize=(10, 1.2 + 3.4 * len(spectra)), layout="constrained")
    axes = fig.subplots(len(spectra), 2, sharex=True, sharey=True, squeeze=False)
    ranks = np.arange(1, head_dim + 1)
    for row, (key, what) in zip(axes, spectra):
        for ax, name in zip(row, ("keys", "values")):
            layers = run[key][name]
            for layer, kept in enumerate(layers):
                # the first layer dark, the last light
                shade = colormaps["viridis"](0.9 * layer / max(1, len(layers) - 1))
                ax.plot(ranks, kept, marker="o", markersize=3, color=shade, label=f"layer {layer}")
            for paper_r, style in ((16, ":"), (46, "--"), (64, "-.")):
                ax.axvline(paper_r * head_dim / 128, color="gray", linestyle=style,
                           label=f"the paper's r = {paper_r} of 128 (here {paper_r * head_dim / 128:g})")
            ax.set_ylim(0, 1.02)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            seen = "the weights alone" if key == "rank_energy" else "as the attention's inputs see them"
            ax.set_title(f"{name.capitalize()}, {seen}")
        row[0].set_ylabel(f"Share of {what} kept")
    for ax in axes[-1]:
        ax.set_xlabel("Rank r of each head's residual")
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside lower center", ncols=4)
    fig.suptitle(f"Rank the Heads Need ({run['label']}, {model_size(run['n_params'])})")
    return fig


def print_table(runs):
    converted = any(run["start"] for run in runs)
    rows = [("", "params", "KV elements/token", "KV at context (bf16)", "% of MHA",
             *(["val loss at step 0"] if converted else []),
             "val loss", "val BPB", "eff. rank (% of H)", "centred (% of H)")]
    for run in runs:
        mean_ranks = [None if run[key] is None else sum(run[key]) / len(run[key])
                      for key in ("effective_rank", "effective_rank_centered")]
        rows.append((
            run["label"],
            f"{run['n_params'] / 1e6:.1f}M",
            str(run["kv_cache_elements_per_token"]),
            f"{run['kv_cache_bytes'] / 1024:,.1f} KiB at {run['context']}",
            f"{100 * run['kv_cache_fraction']:.1f}",
            *([f"{run['start']['val_loss']:.3f}" if run["start"] else "-"] if converted else []),
            "-" if run["val_loss"] is None else f"{run['val_loss']:.3f}",
            "-" if run["val_bpb"] is None else f"{run['val_bpb']:.3f}",
            *("-" if rank is None else f"{rank:.2f} ({100 * rank / run['n_head']:.1f}%)"
              for rank in mean_ranks),
        ))
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        print("  ".join(cells))
    for run in runs:
        if run["layout"]:
            print(f"{run['label']}: {run['layout']}; the ranks are of the layers that own keys, "
                  f"{', '.join(map(str, run['key_layers']))}")


def index_or_mean(value):
    return value if value == "mean" else int(value)


def main(argv=None):
    parser = ArgumentParser(
        prog="analyze.py", description="Head diversity of GPT checkpoints, from their weights alone.")
    parser.add_argument("ckpts", nargs="+", help="checkpoints, or folders holding */ckpt.pt")
    parser.add_argument("--out_dir", type=Path,
                        help="where the figures and analysis.json go (default: the first argument if it is "
                        "a folder, else the first checkpoint's folder)")
    # The paper does not say which layer its heatmaps show. Default: the one where the runs differ
    # most, which is where the variants' heads tell them apart. Not the mean:
    # any order of a layer's heads is the same model, so head i of one layer has nothing to do
    # with head i of the next, and averaging over layers blurs real pairs of heads toward 0.
    parser.add_argument("--layer", type=index_or_mean,
                        help="layer of head_correlation.png: an index, or 'mean' of the layers' similarity "
                        "matrices (default: the layer where the runs' effective ranks differ most)")
    parser.add_argument("--centered", action="store_true",
                        help="plot the PCA-based (double-centred) effective rank")
    args = parser.parse_args(argv)
    first = Path(args.ckpts[0])
    out_dir = args.out_dir or (first if first.is_dir() else first.parent)
    try:
        check_environment()  # analyze.py computes in float64 on the CPU, but refuses what no script takes
        check_writable(out_dir / "analysis.json")  # before the analysis, not after it
    except ConfigError as e:
        sys.exit(str(e))

    paths = []
    for name in map(Path, args.ckpts):
        found = sorted(name.glob("*/ckpt.pt")) if name.is_dir() else [name]
        if not found:
            fail(name, "a folder with no */ckpt.pt in it")
        paths += found
    analysed = sorted((analyze(path) for path in paths), key=lambda config_run: run_order(*config_run))
    configs, runs = zip(*analysed)
    labels = legend_labels(configs, runs)
    runs = [{"label": label, "color": color, **run}
            for label, color, run in zip(labels, colors(labels), runs)]
    if isinstance(args.layer, int):
        for run in runs:
            if not -run["n_layer"] <= args.layer < run["n_layer"]:
                fail(run["ckpt"], f"has {run['n_layer']} layers, so no --layer {args.layer}")

    print_table(runs)
    figures = {
        "effective_rank.png": plot_effective_rank(runs, args.centered),
        "head_correlation.png": plot_head_correlation(runs, args.layer),
        "kv_tradeoff.png": plot_kv_tradeoff(runs),
        "kv_cache.png": plot_kv_cache(runs),
        "loss_curves.png": plot_loss_curves(runs),
        "rank_during_training.png": plot_rank_during_training(runs, args.centered),
    }
    if any(run["tasks_during_training"] for run in runs):  # train.py --eval_tasks
        figures["tasks_during_training.png"] = plot_tasks_during_training(runs)
    mha = next((run for run in runs if run["attn"] == "mha" and run["rank_energy"] and not run["init_from"]),
               None)
    if mha is not None:
        mha["rank_energy_seen"], missing = seen_rank_energy(mha["ckpt"])
        if missing:
            print(f"rank_energy.png from the weights alone, with no inputs to see them through: {missing}")
        figures["rank_energy.png"] = plot_rank_energy(mha, len(mha["rank_energy"]["keys"][0]))
    needs = {"effective_rank.png": "heads that give maps of x (lib/attention/heads.py)",
             "head_correlation.png": "heads that give maps of x (lib/attention/heads.py)",
             "kv_tradeoff.png": "validation numbers", "loss_curves.png": "a log.jsonl beside it",
             "rank_during_training.png": "a log.jsonl with effective ranks beside it"}
    # each file whole or not at all, should the disk fill meanwhile: the last analysis stays whole
    try:
        written = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, fig in figures.items():
            written = out_dir / name
            if fig is None:
                print(f"no checkpoint carries {needs[name]}, so no {name}")
            else:
                with atomic_open(written) as f:
                    fig.savefig(f, format="png", dpi=150)
        written = out_dir / "analysis.json"
        write_atomic(written, json.dumps({"runs": runs}).encode())
    except OSError as e:
        fail(written, f"cannot be written: {e.strerror}")
    print(f"wrote the figures and analysis.json to {out_dir}")


if __name__ == "__main__":
    sys.exit(run_main(main))
