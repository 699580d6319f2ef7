"""
The cache for any layout (layout.py: layers that read another layer's keys, sliding windows), built on
model.py's KVCache, and the rule of which positions a query sees.

model.py's KVCache gives every layer buffers of max_len slots, slot p holding position p. Here a layer
that reads another's keys and values holds none and reads its owner's entries, each layer masks them
with its own window, and an owner whose readers all have windows keeps only the widest reader's W
positions, as a ring. The ring's rule, an invariant that every write keeps:

    an owner's buffers hold `length` slots; once positions 0..pos-1 are stored, slot s holds the latest
    position p < pos with p % length == s (slot_positions), or none yet where s >= pos.

So slot p % length is where position p goes, and a query at position i that sees its last W <= length
positions finds all of them in the ring. One case breaks it: a chunk of T > 1 new tokens (a prefill)
would overwrite positions that its own first queries still see. Such a chunk waits in `pending`, read
beside the ring as the storage gives it back (as_stored: what a layer without a window reads of it), until
advance stores it (its last `length` positions, into their slots, in the order of their positions).
A storage of another kind (quant.py) overrides allocate, store and load, as it would model.py's cache.

Slots count columns, which every row shares; a row's position at a column is its own (row_positions,
model.py's interface). Here prompts of different lengths come left-padded: row b's position at column c
is c - starts[b], a pad's negative, so that each row gets its own RoPE rows and mask (visible) and decodes
as it would alone. hf/modeling_lrkv.py's padded cache gives positions its own way, through the same hook.
decode.py's single-token steps take rows that agree (rope (S, rope_dim)); rows that differ decode by the
plain cached path.
"""

import torch

from model import KVCache


def visible(q_pos, k_pos, window=None):
    """The one attention rule, for training with windows, prefill and every decoding path: the query at
    position i sees the key at position j when j <= i (causal) and, in a layer with a window W,
    i - j < W. A negative key position is an empty slot or a pad, seen by none but a query at that very
    position (a pad sees itself, so that its softmax has a key: pads have positions of their own).
    q_pos (T,) and k_pos (S,) are positions, or (B, T) and (B, S) each row's. Returns the bool mask
    (T, S), or (B, T, S)."""
    k_pos = k_pos.unsqueeze(-2)  # (..., 1, S)
    distance = q_pos.unsqueeze(-1) - k_pos  # (..., T, S)
    seen = (distance >= 0) & (k_pos >= 0) | (distance == 0)
    return seen if window is None else seen & (distance < window)


def masked_softmax(scores, mask, dtype):
    """softmax of scores (B, H, S) in fp32 (fp64 scores in fp64) where mask (None: all; (1, S) bool) allows,
    in dtype. An empty slot's score may be 0 / 0 (a cached key RMS of 0): -inf overwrites it."""
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(dtype)


def gather(buffer, slots):
    """buffer[:, slots], the read of every storage's load: slots a slice, or a 1-D index of slots >= 0
    gathered by index_select, which on a CPU takes a fifth of advanced indexing's time for the paged
    pool's rows (its batch of 1: along the buffer's first dim once the batch is dropped)."""
    if not torch.is_tensor(slots):
        return buffer[:, slots]
    slots = slots.to(buffer.device)
    return buffer[0].index_select(0, slots)[None] if buffer.size(0) == 1 else buffer.index_select(1, slots)


def slot_positions(length, pos, device=None):
    """(length,): the position each slot of a ring of `length` holds once 0..pos-1 are stored, the
    latest p < pos with p % length == slot; negative for a slot not written yet. pos: an int or a (1,)
    tensor (decode.py's fixed-shape cache)."""
    slots = torch.arange(length, device=device)
    return pos - 1 - (pos - 1 - slots) % length


class RingKVCache(KVCache):
    """model.py's KVCache for a layout: model.layout's per-layer facts, kv_source (whose entries a layer
    reads) and windows (how many of its latest positions it sees; None: all), or, for a model without
    a layout, every layer its own and no window. A layer that owns entries keeps `length` slots, the
    widest span of the layers that read it: max_len where one of them sees every position, else the
    widest window W, a ring (the module's rule). write and read are the interface decode.py's exact
    and fixed-shape caches build on."""

    def __init__(self, model, batch_size, max_len, dtype, device):
        n, layout = len(model.blocks), model.layout
        self.kv_source = list(layout.kv_source) if layout else list(range(n))
        self.windows = list(layout.windows) if layout else [None] * n
        # sources[owner]: the attention whose weights turn its entries back into keys and values
        # (cached_keys_values, a step) for every layer that reads them
        self.sources = {layer: model.blocks[layer].attn for layer in set(self.kv_source)}
        self.span = {owner: max(min(self.windows[reader] or max_len, max_len) for reader in range(n)
                                if self.kv_source[reader] == owner) for owner in self.sources}
        self.pending = {}  # owner: a chunk's entries waiting to be stored, and as they read (write)
        self.starts = None  # (B,): each row's first column, left-padded rows; set before the first forward
        super().__init__(model, batch_size, max_len, dtype, device)

    def row_positions(self, columns):
        return columns if self.starts is None else columns - self.starts.to(columns.device)[:, None]

    def length(self, layer):
        return self.span.get(layer, 0)  # a layer that reads another's keys holds no slot

    def attend(self, attn, q, x, rope):
        self.write(attn, x, rope)
        source, entries, rope, mask = self.read(attn, q.size(1))
        return attn.attend(q, *source.cached_keys_values(rope, **entries), mask)

    def write(self, attn, x, rope):
        """An owner's new tokens x (B, T, d) leave their entries: in their slots, or for a chunk that
        would overwrite positions its own queries still see, in pending until advance. A layer that
        reads another's keys writes nothing."""
        layer = attn.layer
        if self.kv_source[layer] != layer:
            return
        entries = attn.cache_entries(x, rope)
        if x.size(1) > 1 and self.pos + x.size(1) > self.length(layer):
            self.pending[layer] = entries, self.as_stored(layer, entries)
        else:
            self.store_positions(layer, entries)

    def as_stored(self, layer, entries):
        """entries {name: (B, T, *shape)} of positions pos.. as the storage gives them back from a layer of
        max_len slots, slot p holding position p (a layer without a window's), so that a chunk's own queries
        read it as the paged cache's do (a quantised storage: quantised), the layer's slots left as they
        are. Through buffers of their own, the layer's put back after."""
        held, span, T = self.layers[layer], self.span[layer], next(iter(entries.values())).size(1)
        shapes = {name: x.shape[2:] for name, x in entries.items()}
        self.layers[layer] = self.allocate(shapes, self.max_len, self.rope.device)
        self.span[layer] = self.max_len
        try:
            slots = torch.arange(self.pos, self.pos + T)
            self.store(layer, slots, entries)
            return self.load(layer, slots)
        finally:
            self.layers[layer], self.span[layer] = held, span

    def store_positions(self, layer, entries):
        """Store entries of positions pos, pos + 1, ... each in its slot p % length: the last `length`, from
        the ring's start (slot 0) at or before the first of them, one turn of the ring at a time, so that
        the slots take their positions in order, as decoding token by token gives them (a storage that
        quantises groups of slots, quant.Int4KVCache, quantises each from the positions it holds)."""
        T, length = next(iter(entries.values())).size(1), self.length(layer)
        first, end = max(self.pos, (self.pos + T - length) // length * length), self.pos + T
        while first < end:
            stop = min(end, (first // length + 1) * length)  # this turn's end
            self.store(layer, torch.arange(first, stop) % length,
                       {name: x[:, first - self.pos:stop - self.pos] for name, x in entries.items()})
            first = stop

    def held(self, attn, T, codes=False):
        """The entries attn's T new queries at columns pos..pos+T-1 read, {name: (B, S, *shape)} (their
        owner's slots written, then any pending chunk), their owner, and the column each holds (S,).
        codes: as load_codes hands them."""
        owner = self.kv_source[attn.layer]
        pending = self.pending[owner][1] if owner in self.pending else None
        ahead = 0 if pending is not None else T  # the queries' own positions, already in the slots
        held = min(self.pos + ahead, self.length(owner))
        entries = (self.load_codes if codes else self.load)(owner, slice(0, held))
        positions = slot_positions(self.length(owner), self.pos + ahead, self.rope.device)[:held]
        if pending is not None:
            entries = {name: torch.cat((x, pending[name]), 1) for name, x in entries.items()}
            positions = torch.cat((positions, torch.arange(self.pos, self.pos + T, device=positions.device)))
        return owner, entries, positions

    def read(self, attn, T, codes=False):
        """What attn's T new queries see, as model.py's KVCache.attend uses it: the attention whose entries
        they are (attn's owner), those entries (held), their RoPE rows (S, rope_dim), or (B, S, rope_dim)
        where rows differ, and the mask (T, S), or (B, 1, T, S), of visible with attn's window and each
        row's positions (None where Attention.attend's own rule is it)."""
        owner, entries, columns = self.held(attn, T, codes)
        window, pending = self.windows[attn.layer], owner in self.pending
        q_pos = self.row_positions(torch.arange(self.pos, self.pos + T, device=columns.device))
        k_pos = self.row_positions(columns)  # (S,), or (B, S) where rows differ
        agree = k_pos.dim() == 1
        plain = agree and window is None and (T == 1 or self.pos == 0 and not pending)  # Attention.attend's
        mask = None if plain else visible(q_pos, k_pos, window)
        mask = mask if agree or mask is None else mask.unsqueeze(1)  # (B, 1, T, S): the same for every head
        # while no slot has wrapped, slot s holds position s: a view of the table, not a gather
        unwrapped = agree and not pending and self.pos + T <= self.length(owner)
        rope = self.rope[:len(columns)] if unwrapped else self.rope[k_pos.clamp(min=0)]
        return self.sources[owner], entries, rope, mask

    def load(self, layer, slots):  # model.py's, by gather
        return {name: gather(buf, slots).to(self.dtypes[layer][name])
                for name, buf in self.layers[layer].items()}

    def load_codes(self, layer, slots):
        """load's entries, for a step that reads a quantised storage's codes (quant.py's, its own): here the
        same tensors."""
        return self.load(layer, slots)

    def advance(self, T):
        for layer, (entries, _) in self.pending.items():
            self.store_positions(layer, entries)
        self.pending = {}
        super().advance(T)
