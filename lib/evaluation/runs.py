"""
How a run is named and ordered wherever runs are shown together (analyze.py's figures and table,
eval.py's table): its variant's legend label in the paper's order, and where it started from
(train.py --init_from), read off its checkpoint.
"""

import dataclasses
from pathlib import Path

from lib.attention.layout import kv_source, layer_window
from lib.training.checkpoint import load_checkpoint
from lib.training.configurator import ConfigError


def provenance(ckpt, config):
    """What a run's label reads of it besides its config: where it started (--init_from, and that
    checkpoint's model_args), whether it was converted by the whitened SVD (a checkpoint from before
    --calibration_tokens was not) and uptrained with --distill, each drawn apart (line_style,
    plot_kv_tradeoff)."""
    train_config = ckpt.get("config", {})
    init_from = train_config.get("init_from") or None
    init_from_args = source_args(init_from)
    converted = init_from_args is not None and init_from_args != dataclasses.asdict(config)
    return dict(init_from=init_from, init_from_args=init_from_args,
                whitened=converted and train_config.get("calibration_tokens", 0) > 0,
                distilled=train_config.get("distill", 0) > 0)


def run_order(config, run):
    """Where a run sorts among others: runs from scratch first, then converted ones, each in the
    paper's legend order."""
    return run["init_from"] is not None, legend_key(config)


def source_args(path):
    """The model_args of the checkpoint a run started from, or None if it is gone."""
    try:
        return load_checkpoint(path)[0]["model_args"] if path else None
    except ConfigError:
        return None


def mla_label(config, peers):
    # d_c only where it tells the MLA runs apart
    return f"MLA (d_c={config.kv_lora_rank})" if len({p.kv_lora_rank for p in peers}) > 1 else "MLA"


# Each variant's legend label (of its config and the configs of every run of it in the figures) and
# its runs' order by size, by --attn name, in the paper's legend order (which gives matplotlib's
# default colours in its figure). A variant not here is labelled by its --attn name, after these.
LEGEND = {
    "mha": (lambda config, peers: "Standard MHA", lambda config: 0),
    "lrkv": (lambda config, peers: f"LRKV (r={config.lrkv_rank})", lambda config: config.lrkv_rank),
    "mqa": (lambda config, peers: "MQA", lambda config: 0),
    "mla": (mla_label, lambda config: config.kv_lora_rank),
    "gqa": (lambda config, peers: f"GQA ({config.n_kv_head} KV heads)", lambda config: config.n_kv_head),
    # lib/attention/rivals.py's, after the paper's five, each named as its paper names its default
    "gta": (lambda config, peers: f"GTA ({config.gta_kv_heads} KV heads)",
            lambda config: config.gta_kv_heads),
    "gla": (lambda config, peers: f"GLA-{config.gla_latent_heads}", lambda config: config.gla_latent_heads),
    "tpa": (lambda config, peers: "TPA", lambda config: config.tpa_kv_rank),
    # the authors' MLRA-4 is this layout with 4 latent heads; their MLRA-2 is another (two branches)
    "mlra": (lambda config, peers: f"MLRA ({config.mlra_latent_heads} latent heads)",
             lambda config: config.mlra_latent_heads),
}


def legend_key(config):
    """Where a run sorts: its variant's place in LEGEND, then by size; a variant not there after them."""
    if config.attn not in LEGEND:
        return len(LEGEND), config.attn, 0, config.cla
    return list(LEGEND).index(config.attn), config.attn, LEGEND[config.attn][1](config), config.cla


def variant_label(config, peers):
    """A variant's own legend label (LEGEND's, given the configs of every run of it), or its --attn
    name; "+ CLA2" where its layers share keys and values in pairs (--cla=2), as the CLA paper's
    MQA-CLA2, "+ YOCO" where the upper half shares the middle layer's, and "+ SWA W (pattern)" where
    layers see a sliding window of W positions."""
    label = LEGEND[config.attn][0](config, peers) if config.attn in LEGEND else config.attn
    label += (f" + CLA{config.cla}" if config.cla > 1 else "") + (" + YOCO" if config.yoco else "")
    return label + (f" + SWA {config.window} ({config.window_pattern})" if config.window else "")


def layout(config):
    """How a model's layers share keys and see positions, in words ("" for every layer its own keys
    and all positions): sample.py's header and analyze.py's table say it."""
    def layers(numbers):
        return ("layer " if len(numbers) == 1 else "layers ") + ", ".join(map(str, numbers))
    n = range(config.n_layer)
    sharing = {layer: kv_source(config, layer) for layer in n if kv_source(config, layer) != layer}
    local = [layer for layer in n if layer_window(config, layer)]
    parts = []
    if sharing:
        sources = sorted(set(sharing.values()))
        parts.append(f"{layers(list(sharing))} attend with the keys and values of {layers(sources)}")
    if local:
        parts.append(f"{layers(local)} see their last {config.window} positions")
    return "; ".join(parts)


def legend_labels(configs, runs):
    """The paper's legend labels, each variant's own (variant_label), and for a run
    started from another checkpoint "uptrained" (the same model) or "converted" (another, and
    "whitened" when the conversion was calibrated on the inputs), or "from a checkpoint" where
    that one is gone, each "distilled" when uptrained with --distill; a label that would still
    name two checkpoints (two seeds, say) gets each one's folder appended."""
    def started(config, run):
        if not run["init_from"]:
            return ""
        if run["init_from_args"] is None:
            how = ", from a checkpoint"
        elif run["init_from_args"] == dataclasses.asdict(config):
            how = ", uptrained"
        else:
            how = ", converted, whitened" if run["whitened"] else ", converted"
        return how + (", distilled" if run["distilled"] else "")
    names = [variant_label(c, [peer for peer in configs if peer.attn == c.attn])
             + started(c, run) for c, run in zip(configs, runs)]
    ckpts = [run["ckpt"] for run in runs]
    return [f"{name} ({Path(ckpt).parent})" if names.count(name) > 1 else name
            for name, ckpt in zip(names, ckpts)]
