"""
Layouts: which layer's keys and values a layer attends with, and how many of its latest positions it
sees, a layer on top of model.py's attention, for every variant.

  --cla=N        cross-layer attention (Brandon et al. 2024): in each group of N consecutive layers the
                 first computes keys and values and the others read them, holding no key or value
                 weights, so the cache falls by N.
  --yoco         the upper half of the layers reads the middle layer's (YOCO, LCKV).
  --window=W     sliding windows: the layers marked S in --window_pattern (nanochat's letters, tiled over
                 the layers, the last layer always L) see their last W positions, the L layers all.

A window is its reader's own: an L layer may read an S layer's keys, whose cache then keeps every
position. GPTConfig has check refuse fields that cannot make a layout; GPT builds a Layout where the
config asks for one (GPTConfig's cla, yoco, window). The Layout turns the config into plain per-layer
facts, kv_source and windows; takes the key and value weights of the layers that read another's; gives
training a LayoutMemory (model.py's Attention.forward calls its attend); and gives decoding ring.py's
RingKVCache, which reads the same facts.
"""

import torch

from lib.attention.ring import RingKVCache, visible


def check(config):
    """A ValueError of one line naming the first of the layout's fields that cannot make the model. GPTConfig
    calls it where the config asks for a layout, after checking each field's type and sign itself."""
    L = config.block_size
    for field, ok, allowed in (
            ("cla", config.n_layer % config.cla == 0, f"a divisor of n_layer = {config.n_layer}"),
            ("n_layer", not config.yoco or config.n_layer % 2 == 0, "even with --yoco (its two halves)"),
            ("window", (config.window or 1) <= L, f"from 1 to block_size = {L}"),
            ("window_pattern", config.window_pattern and not set(config.window_pattern) - set("SL"),
             "letters S (a layer sees its last --window positions) and L (all)")):
        if not ok:
            config.reject(field, allowed)


def kv_source(config, layer):
    """The layer whose keys and values `layer` attends with: itself where it computes its own."""
    if config.yoco and layer >= config.n_layer // 2:
        return config.n_layer // 2
    return layer - layer % config.cla


def layer_window(config, layer):
    """How many of its latest positions `layer` sees: config.window for an S layer, None (all) for L."""
    letter = config.window_pattern[layer % len(config.window_pattern)]
    return config.window if letter == "S" and layer < config.n_layer - 1 else None


def key_layers(model):
    """The layers that compute keys and values: every layer but those that read another's."""
    return [layer for layer in range(len(model.blocks)) if model.layout is None or
            model.layout.kv_source[layer] == layer]


def kv_cache_elements_per_token(model):
    """Cached elements per token, summed over the layers that compute keys (2 n_layer H d_h for MHA),
    before windows."""
    attns = [model.blocks[layer].attn for layer in key_layers(model)]
    return sum(torch.Size(shape).numel() for attn in attns for shape in attn.cache_shapes().values())


class Layout:
    """A model's layout: kv_source[layer] and windows[layer], the facts that training and the cache read."""

    cache_class = RingKVCache

    def __init__(self, config, model):
        self.kv_source = [kv_source(config, layer) for layer in range(config.n_layer)]
        self.windows = [layer_window(config, layer) for layer in range(config.n_layer)]
        # the owners another layer reads, whose keys training keeps for it
        self.shared = {owner for layer, owner in enumerate(self.kv_source) if owner != layer}
        for layer, block in enumerate(model.blocks):
            if self.kv_source[layer] != layer:  # it reads another's keys: it keeps its queries' weights (W_q,
                # or a variant's query_weights, as TPA's factors), those its attend reads (a variant's
                # attend_weights) and W_o; its key and value weights go (MHA's W_k, W_v; LRKV's W_shared_k ...
                # B_v; MLA's W_down, W_up_k, W_up_v, W_kr)
                attn = block.attn
                keep = {*getattr(attn, "query_weights", ("W_q",)), *getattr(attn, "attend_weights", ()),
                        "W_o"}
                for name, _ in [*attn.named_children(), *attn.named_parameters(recurse=False)]:
                    if name not in keep:
                        delattr(attn, name)

    def memory(self):
        """What one training forward attends through."""
        return LayoutMemory(self)


class LayoutMemory:
    """Training's attention under a layout, for one forward: a layer that owns its keys computes them
    (keeping them only where another layer reads them: memory), a reader takes its owner's, and a layer
    with a window W sees only its last W positions (visible)."""

    def __init__(self, layout):
        self.layout, self.kvs = layout, {}

    def attend(self, attn, q, x, rope):
        layer, owner = attn.layer, self.layout.kv_source[attn.layer]
        if owner == layer:
            k, v = attn.keys_values(x, rope)
            if layer in self.layout.shared:
                self.kvs[layer] = k, v
        else:  # an owner comes before its readers (kv_source[layer] <= layer): it ran in this forward
            k, v = self.kvs[owner]
        window, positions = self.layout.windows[layer], torch.arange(x.size(1), device=x.device)
        mask = None if window is None else visible(positions, positions, window)  # (T, T), True: j seen by i
        return attn.attend(q, k, v, mask)
