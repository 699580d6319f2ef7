"""
Quantised cache storage: int8 and int4 caches, each one class on the cache interface (model.py's
KVCache: allocate, store and load are the one place buffers are made, written and read), built on
ring.RingKVCache, so that it holds for every variant and layout (--cla, --yoco, windows and their ring)
and under every decoding path (decode.py's exact and fixed-shape caches are views over it).

What a variant caches (its cache_shapes) is not all keys and values: LRKV caches a shared key and
per-head residual coordinates, MLA a latent and a RoPE key, and several a key RMS, rho. Each entry is
quantised along its last dim, with a scale for each of its rows (a token's head, say); rho is never
quantised, in either class: it divides every score of its head and position, so an int8 error of
up to 0.4% of a row's largest would move whole softmaxes, for H numbers a token (0.7% of LRKV's cache
at 128M).

Int8KVCache: symmetric absmax per row, q = round(x / s) in [-127, 127], s = max|x| / 127, stored in
the cache's dtype. Int4KVCache: KIVI's scheme (Liu et al. 2024), asymmetric, q = round((x - m) / s) in
[0, 15], two to a byte: a key entry (KEYS: the entries that make keys; their outlier channels are
KIVI's reason) per channel over groups of `group` consecutive slots, the newest slots of the group not
yet full held in full precision in a residual until it fills; every other entry per token, row by row.

Quantising uses the scale as stored (rounded to the cache's dtype), so that load gives exactly
q s + m, the values a plain cache would hold had it been given them: decoding from a quantised cache
is the plain model's on those values (tests/test_quant.py checks every path against that).
"""

import functools

import torch

from lib.attention.ring import RingKVCache

KEPT = ("rho",)  # entries stored as they are, in the cache's dtype (above)
# the entries that make keys, which Int4KVCache quantises per channel: GQA's keys, LRKV's shared key
# and key residual coordinates, the RoPE keys of MLA, GTA, GLA and MLRA, TPA's key factors
KEYS = ("k", "k_shared", "r_k", "k_rope", "a_k", "b_k")


class QuantisedKVCache(RingKVCache):
    """What both storages share: a KEPT entry held as it is, in the cache's dtype; every other one through
    the subclass's allocate_entry (its buffers, {name: ..., name.scale: ...}), store_entry and load_entry
    (fp32 values), cast back to the dtype it was computed in."""

    def allocate(self, shapes, length, device):
        buffers = {}
        for name, shape in shapes.items():
            if name in KEPT:
                buffers[name] = torch.zeros(self.batch_size, length, *shape, dtype=self.dtype, device=device)
            else:
                buffers.update(self.allocate_entry(name, shape, length, device))
        return buffers

    def store(self, layer, slots, entries):
        self.dtypes.setdefault(layer, {name: x.dtype for name, x in entries.items()})
        buffers = self.layers[layer]
        for name, x in entries.items():
            if name in KEPT:
                buffers[name][:, slots] = x.to(self.dtype)
            else:
                self.store_entry(layer, buffers, name, slots, x)

    def load(self, layer, slots):
        buffers, out = self.layers[layer], {}
        for name, dtype in self.dtypes[layer].items():
            x = buffers[name][:, slots] if name in KEPT else self.load_entry(buffers, name, slots)
            out[name] = x.to(dtype)
        return out


class Int8KVCache(QuantisedKVCache):
    """int8 entries with a scale per row (the last dim), rho as it is (module docstring)."""

    def allocate_entry(self, name, shape, length, device):
        B = self.batch_size
        return {name: torch.zeros(B, length, *shape, dtype=torch.int8, device=device),
                f"{name}.scale": torch.zeros(B, length, *shape[:-1], 1, dtype=self.dtype, device=device)}

    def store_entry(self, layer, buffers, name, slots, x):
        x = x.float()
        scale = (x.abs().amax(-1, keepdim=True) / 127).to(self.dtype)  # as stored
        q = torch.round(x / scale.float().clamp(min=torch.finfo(torch.float32).tiny)).clamp(-127, 127)
        buffers[name][:, slots] = q.to(torch.int8)
        buffers[f"{name}.scale"][:, slots] = scale

    def load_entry(self, buffers, name, slots):
        return buffers[name][:, slots].float() * buffers[f"{name}.scale"][:, slots].float()


def int4_codes(x, low, scale):
    """Asymmetric 4-bit codes of x in [0, 15] for the stored low m and scale s, fp32, packed two to a byte
    along the last dim (even): the first of a pair in the low 4 bits."""
    q = torch.round((x - low.float()) / scale.float().clamp(min=torch.finfo(torch.float32).tiny)).clamp(0, 15)
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def int4_values(packed, low, scale):
    """What int4_codes packed stands for, q s + m, fp32 (..., 2 * packed's last dim)."""
    q = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).float()
    return q * scale.float() + low.float()


def token_rows(shape):
    """The dims a per-token int4 group spans of an entry of shape: its last, or its last two where the last
    is narrower than 64 numbers (LRKV's r_v, TPA's head factors: a low and a scale every r = 46 numbers
    would weigh 9% of the codes)."""
    return (-1,) if shape[-1] >= 64 or len(shape) < 2 else (-2, -1)


def low_scale(x, dim, dtype):
    """The asymmetric range of x over dim, as stored: its minimum m, and s = (max - m) / 15."""
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    return low.to(dtype), ((high - low) / 15).to(dtype)


class Int4KVCache(QuantisedKVCache):
    """int4 entries two to a byte (module docstring): a KEYS entry per channel over groups of G = `group`
    slots (all of them where fewer), the group being filled held in full precision in `{name}.residual`
    until it is full (or ends at the last slot), then quantised whole; every other entry per token, row
    by row; rho as it is. An entry's last dim must be even (two codes a byte)."""

    group = 64  # G: the slots a key group's scales cover (KIVI's 32 to 128)

    def allocate_entry(self, name, shape, length, device):
        if shape[-1] % 2:
            raise ValueError(f"an int4 cache packs two codes a byte: entry {name} is {shape[-1]} wide, odd")
        B, G, packed = self.batch_size, min(self.group, max(length, 1)), (*shape[:-1], shape[-1] // 2)
        zeros = functools.partial(torch.zeros, dtype=self.dtype, device=device)
        if name in KEYS:  # per channel, over each group of G slots; the codes padded to whole groups
            groups = -(-length // G)
            # filling, the same for every row: the group being filled's first slot, and its slots filled
            return {name: torch.zeros(B, groups * G, *packed, dtype=torch.uint8, device=device),
                    f"{name}.low": zeros(B, groups, *shape), f"{name}.scale": zeros(B, groups, *shape),
                    f"{name}.residual": zeros(B, G, *shape),
                    f"{name}.filling": torch.zeros(B, 2, dtype=torch.long, device=device)}
        rows = token_rows(shape)  # per token, a row or two
        per_token = (B, length, *shape[:-len(rows)], *[1] * len(rows))
        return {name: torch.zeros(B, length, *packed, dtype=torch.uint8, device=device),
                f"{name}.low": zeros(per_token), f"{name}.scale": zeros(per_token)}

    def store_entry(self, layer, buffers, name, slots, x):
        if name in KEYS:
            slots = torch.as_tensor(slots, device=x.device).view(-1)
            for t in range(x.size(1)):  # a slot at a time: each may fill a group
                self.store_key_slot(buffers, name, self.length(layer), slots[t:t + 1], x[:, t:t + 1])
        else:
            low, scale = low_scale(x.float(), token_rows(x.shape[2:]), self.dtype)
            buffers[name][:, slots] = int4_codes(x.float(), low, scale)
            buffers[f"{name}.low"][:, slots], buffers[f"{name}.scale"][:, slots] = low, scale

    def store_key_slot(self, buffers, name, length, slot, x):
        """One slot (a (1,) tensor) of a key entry, x (B, 1, *shape): into the residual and, where it fills
        its group (the group's last slot, or the last of all), the group quantised per channel from the
        residual. With no branch on the slot, so that a compiled fixed-shape step runs it as it is."""
        data, residual, filling = buffers[name], buffers[f"{name}.residual"], buffers[f"{name}.filling"]
        G = residual.size(1)
        start = slot - slot % G  # (1,): the group's first slot
        index = slot - start  # (1,): the slot's place in the group
        residual[:, index] = x.to(residual.dtype)
        full = index + 1 == torch.clamp(length - start, max=G)  # (1,): the group's last slot
        # per channel over the group's slots filled so far, the first standing in for the others
        held = (torch.arange(G, device=slot.device) <= index).view(1, G, *[1] * (residual.dim() - 2))
        values = torch.where(held, residual.float(), residual[:, :1].float())  # (B, G, *shape)
        low, scale = low_scale(values, 1, self.dtype)  # (B, 1, *shape)
        group = start // G
        for buffer, new in ((buffers[f"{name}.low"], low), (buffers[f"{name}.scale"], scale)):
            buffer[:, group] = torch.where(full, new, buffer[:, group])
        group_slots = start + torch.arange(G, device=slot.device)  # (G,): inside the padded codes
        full_here = full.view(1, 1, *[1] * (data.dim() - 2))
        data[:, group_slots] = torch.where(full_here, int4_codes(values, low, scale), data[:, group_slots])
        filling[:, 0], filling[:, 1] = start, torch.where(full, torch.zeros_like(index), index + 1)

    def load(self, layer, slots):  # the slots as an index (S,), for the groups' arithmetic
        return super().load(layer, torch.arange(self.length(layer), device=self.rope.device)[slots])

    def load_entry(self, buffers, name, index):
        if name not in KEYS:
            return int4_values(buffers[name][:, index], buffers[f"{name}.low"][:, index],
                               buffers[f"{name}.scale"][:, index])
        residual = buffers[f"{name}.residual"]
        groups = index // residual.size(1)
        values = int4_values(buffers[name][:, index], buffers[f"{name}.low"][:, groups],
                             buffers[f"{name}.scale"][:, groups])
        # the slots of the group being filled are the residual's, in full precision
        start, filled = buffers[f"{name}.filling"][0, 0], buffers[f"{name}.filling"][0, 1]
        fresh = ((index >= start) & (index < start + filled)).view(1, -1, *[1] * (values.dim() - 2))
        within = (index - start).clamp(0, residual.size(1) - 1)  # (S,): its place in the residual
        return torch.where(fresh, residual[:, within].float(), values)


CACHES = {"none": RingKVCache, "int8": Int8KVCache, "int4": Int4KVCache}


def cache_class(kv_quant):
    """The cache class of a --kv_quant name, or a ValueError of one line."""
    if kv_quant not in CACHES:
        raise ValueError(f"--kv_quant={kv_quant!r}: must be one of {', '.join(CACHES)}")
    return CACHES[kv_quant]
