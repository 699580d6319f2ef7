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

A step of decode.CODE_STEPS (MHA's, GQA's, MQA's, LRKV's, MLA's) reads an entry through Codes (the end
of this file): its scores and weighted sums over the codes as they lie, each scale moved onto the
scores, the weights or the query, the codes read by PyTorch's weight-only int8 kernel or converted a
chunk at a time in the processor's cache; never a dequantised copy of the whole cache per step. On a
CPU, quant.c (through quant_c.py) does the int4 reads, LRKV's int8 residual keys and both storages'
quantising of a new token instead, each in one pass over the codes or the token, where PyTorch's ops
take several passes or a dozen small ops; elsewhere (a GPU, fp64, torch.compile, no C compiler) the
PyTorch ops here, which give the same numbers.
"""

import functools
import math

import torch

from lib.attention import quant_c
from lib.attention.ring import RingKVCache, gather

KEPT = ("rho",)  # entries stored as they are, in the cache's dtype (above)
# the entries that make keys, which Int4KVCache quantises per channel: GQA's keys, LRKV's shared key
# and key residual coordinates, the RoPE keys of MLA, GTA, GLA and MLRA, TPA's key factors
KEYS = ("k", "k_shared", "r_k", "k_rope", "a_k", "b_k")


# How the codes lie in memory, for the kernels of the fast reads (below); the bytes are the same. An entry
# of HEAD_MAJOR, (B, L, G, d) to its readers, is held (B, G, L, d): a head's keys contiguous, rows of a
# scores GEMM; one of POSITION_LAST, (B, L, *rows, d), is held (B, *rows, d, L): a channel's positions
# contiguous, rows of a weighted sum's GEMM. Either is a view of the other: store and load index it as
# they would the plain layout. The int8 cache holds LRKV's r_k position-last too, the int4 cache every
# entry of KEYS: the layouts of their reads in C (quant.c).
HEAD_MAJOR = ("k",)
POSITION_LAST = ("v", "v_shared", "r_v")
INT8_POSITION_LAST = POSITION_LAST + ("r_k",)
INT4_POSITION_LAST = POSITION_LAST + KEYS


def laid_out(name, size, dtype, device, position_last, head_major):
    """A zero buffer of logical size (B, L, *shape), held in the order above for name (the storage's
    position_last and head_major)."""
    n = len(size)
    if name in position_last:
        order = (0, *range(2, n), 1)
    elif name in head_major and n == 4:
        order = (0, 2, 1, 3)
    else:
        return torch.zeros(size, dtype=dtype, device=device)
    held = torch.zeros([size[i] for i in order], dtype=dtype, device=device)
    return held.permute([order.index(i) for i in range(n)])  # (B, L, *shape) again


def in_c(dtype, *tensors):
    """Whether quant.c computes for these tensors, in dtype: on a CPU, where it is built, and short of fp64
    (the tests' exact decodes: C computes in fp32)."""
    return dtype != torch.float64 and quant_c.takes(*tensors)


def wide(x):
    """x in fp32, the quantisers' arithmetic; in fp64 where it is already (a cache in fp64: the tests'
    decodes that no rounding of fp32 may flip a code in)."""
    return x if x.dtype == torch.float64 else x.float()


class QuantisedKVCache(RingKVCache):
    """What both storages share: a KEPT entry held as it is, in the cache's dtype; every other one through
    the subclass's allocate_entry (its buffers, {name: ..., name.scale: ...}), store_entry and load_entry
    (fp32 values), cast back to the dtype it was computed in; load_codes, the same slots as Codes, for the
    steps that read codes (decode.py). position_last and head_major: the entries held in those orders
    (above), for the reads of Codes; a cache whose reads gather slots (paged.py's pool) holds none so."""

    position_last, head_major = POSITION_LAST, HEAD_MAJOR

    @property
    def layouts(self):
        return self.position_last, self.head_major

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
            x = gather(buffers[name], slots) if name in KEPT else self.load_entry(buffers, name, slots, dtype)
            out[name] = x.to(dtype)
        return out

    def load_codes(self, layer, slots):
        """load's entries of the first S slots (slots: slice(0, S) or slice(None)), each held entry as the
        storage's Codes over them, a KEPT one as load gives it."""
        buffers, S = self.layers[layer], len(range(self.length(layer))[slots])
        if slots != slice(0, S) and slots != slice(None):
            raise ValueError(f"codes are read from the first slots on, not {slots}")
        return {name: buffers[name][:, :S].to(dtype) if name in KEPT else self.codes(buffers, name, S, dtype)
                for name, dtype in self.dtypes[layer].items()}

    def slot_index(self, start, stop, device):  # slots start..stop-1 as load_entry takes them
        return slice(start, stop)


class Int8KVCache(QuantisedKVCache):
    """int8 entries with a scale per row (the last dim), rho as it is (module docstring)."""

    position_last = INT8_POSITION_LAST

    def allocate_entry(self, name, shape, length, device):
        B = self.batch_size
        return {name: laid_out(name, (B, length, *shape), torch.int8, device, *self.layouts),
                f"{name}.scale": torch.zeros(B, length, *shape[:-1], 1, dtype=self.dtype, device=device)}

    def store_entry(self, layer, buffers, name, slots, x):
        if in_c(x.dtype, x, buffers[name], buffers[f"{name}.scale"]):
            if quant_c.int8_store(x, slots, buffers[name], buffers[f"{name}.scale"]):  # the same, in C
                return
        x = wide(x)
        scale = (x.abs().amax(-1, keepdim=True) / 127).to(self.dtype)  # as stored
        q = torch.round(x / wide(scale).clamp(min=torch.finfo(torch.float32).tiny)).clamp(-127, 127)
        buffers[name][:, slots] = q.to(torch.int8)
        buffers[f"{name}.scale"][:, slots] = scale

    def load_entry(self, buffers, name, slots, dtype=None):
        """The values c s in fp32, or in dtype where the scale is held in it (bf16, fp16): there a code
        times its scale is exact in fp32, so one rounding to dtype gives what fp32's then dtype's do. One
        row's slots held slot by slot (the paged pool's) in one pass in C, the same numbers."""
        codes, scale = buffers[name], buffers[f"{name}.scale"]
        if (torch.is_tensor(slots) and codes.size(0) == 1 and codes.is_contiguous() and
                dtype in (torch.float32, torch.bfloat16) and in_c(dtype, codes, scale)):  # one row's slots
            return quant_c.int8_gather(codes[0], scale[0], slots, dtype)[None]  # (the paged pool's): in C
        scale = gather(scale, slots)
        if not (dtype == scale.dtype and dtype in (torch.bfloat16, torch.float16)):
            scale = wide(scale)
        return gather(buffers[name], slots).to(scale.dtype) * scale

    def codes(self, buffers, name, S, dtype):
        return Int8Codes(self, buffers, name, S, dtype)


def int4_codes(x, low, scale):
    """Asymmetric 4-bit codes of x in [0, 15] for the stored low m and scale s, fp32, packed two to a byte
    along the last dim (even, d): channel i in the low 4 bits of byte i, channel d/2 + i in its high 4, so
    that each half's codes are one mask or shift of the bytes, in order (Int4Codes' reads)."""
    q = torch.round((x - wide(low)) / wide(scale).clamp(min=torch.finfo(torch.float32).tiny)).clamp(0, 15)
    q = q.to(torch.uint8)
    low_half, high_half = q.chunk(2, dim=-1)
    return low_half | (high_half << 4)


def int4_values(packed, low, scale):
    """What int4_codes packed stands for, q s + m, fp32 (..., 2 * packed's last dim)."""
    scale = wide(scale)
    q = torch.cat((packed & 15, packed >> 4), dim=-1).to(scale.dtype)
    return q * scale + wide(low)


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
    position_last = INT4_POSITION_LAST

    def allocate_entry(self, name, shape, length, device):
        if shape[-1] % 2:
            raise ValueError(f"an int4 cache packs two codes a byte: entry {name} is {shape[-1]} wide, odd")
        B, G, packed = self.batch_size, min(self.group, max(length, 1)), (*shape[:-1], shape[-1] // 2)
        zeros = functools.partial(torch.zeros, dtype=self.dtype, device=device)
        if name in KEYS:  # per channel, over each group of G slots; the codes padded to whole groups
            groups = -(-length // G)
            # filling, the same for every row: the group being filled's first slot, and its slots filled
            return {name: laid_out(name, (B, groups * G, *packed), torch.uint8, device, *self.layouts),
                    f"{name}.low": zeros(B, groups, *shape), f"{name}.scale": zeros(B, groups, *shape),
                    f"{name}.residual": zeros(B, G, *shape),
                    f"{name}.filling": torch.zeros(B, 2, dtype=torch.long, device=device)}
        rows = token_rows(shape)  # per token, a row or two
        per_token = (B, length, *shape[:-len(rows)], *[1] * len(rows))
        return {name: laid_out(name, (B, length, *packed), torch.uint8, device, *self.layouts),
                f"{name}.low": zeros(per_token), f"{name}.scale": zeros(per_token)}

    def store_entry(self, layer, buffers, name, slots, x):
        if name in KEYS:
            slots = torch.as_tensor(slots, device=x.device).view(-1)
            for t in range(x.size(1)):  # a slot at a time: each may fill a group
                self.store_key_slot(buffers, name, self.length(layer), slots[t:t + 1], x[:, t:t + 1])
        elif in_c(x.dtype, x, buffers[name], buffers[f"{name}.low"]) and \
                quant_c.int4_store(x, slots, buffers[name], buffers[f"{name}.low"], buffers[f"{name}.scale"],
                                   math.prod(x.shape[2:][-len(token_rows(x.shape[2:])):-1])):
            return  # the same, in C
        else:
            low, scale = low_scale(wide(x), token_rows(x.shape[2:]), self.dtype)
            buffers[name][:, slots] = int4_codes(wide(x), low, scale)
            buffers[f"{name}.low"][:, slots], buffers[f"{name}.scale"][:, slots] = low, scale

    def store_key_slot(self, buffers, name, length, slot, x):
        """One slot (a (1,) tensor) of a key entry, x (B, 1, *shape): into the residual and, where it fills
        its group (the group's last slot, or the last of all), the group quantised per channel from the
        residual. With no branch on the slot on a device or under torch.compile, so that a compiled
        fixed-shape step runs it as it is; a slot on the host that leaves its group unfilled (63 steps of
        64) goes into the residual alone, in Python's numbers: the group's quantising would change nothing."""
        data, residual, filling = buffers[name], buffers[f"{name}.residual"], buffers[f"{name}.filling"]
        G = residual.size(1)
        if slot.device.type == "cpu" and not torch.compiler.is_compiling():
            index = int(slot) % G
            if index + 1 < min(length - (int(slot) - index), G):  # not the group's last slot
                residual[:, index] = x[:, 0]
                filling[:, 0], filling[:, 1] = int(slot) - index, index + 1
                return
        start = slot - slot % G  # (1,): the group's first slot
        index = slot - start  # (1,): the slot's place in the group
        residual[:, index] = x.to(residual.dtype)
        full = index + 1 == torch.clamp(length - start, max=G)  # (1,): the group's last slot
        filling[:, 0], filling[:, 1] = start, torch.where(full, torch.zeros_like(index), index + 1)
        # per channel over the group's slots filled so far, the first standing in for the others
        held = (torch.arange(G, device=slot.device) <= index).view(1, G, *[1] * (residual.dim() - 2))
        values = torch.where(held, wide(residual), wide(residual[:, :1]))  # (B, G, *shape)
        low, scale = low_scale(values, 1, self.dtype)  # (B, 1, *shape)
        group = start // G
        for buffer, new in ((buffers[f"{name}.low"], low), (buffers[f"{name}.scale"], scale)):
            buffer[:, group] = torch.where(full, new, buffer[:, group])
        group_slots = start + torch.arange(G, device=slot.device)  # (G,): inside the padded codes
        full_here = full.view(1, 1, *[1] * (data.dim() - 2))
        data[:, group_slots] = torch.where(full_here, int4_codes(values, low, scale), data[:, group_slots])

    def load(self, layer, slots):  # the slots as an index (S,), for the groups' arithmetic
        return super().load(layer, torch.arange(self.length(layer), device=self.rope.device)[slots])

    def slot_index(self, start, stop, device):
        return torch.arange(start, stop, device=device)

    def codes(self, buffers, name, S, dtype):
        return Int4Codes(self, buffers, name, S, dtype)

    def load_entry(self, buffers, name, index, dtype=None):
        """The values q s + m in fp32; one row's slots held slot by slot (the paged pool's), in dtype in one
        pass in C (the same numbers), where no slot is the residual's."""
        packed, low, scale = (buffers[f"{name}{part}"] for part in ("", ".low", ".scale"))
        filling = buffers.get(f"{name}.filling")
        if (packed.size(0) == 1 and packed.is_contiguous() and dtype in (torch.float32, torch.bfloat16)
                and in_c(dtype, packed, low) and (filling is None or int(filling[0, 1]) == 0)):
            shape = (*packed.shape[2:-1], 2 * packed.size(-1))
            group = buffers[f"{name}.residual"].size(1) if name in KEYS else None
            rows = 1 if name in KEYS or len(token_rows(shape)) == 1 else shape[-2]
            return quant_c.int4_gather(packed[0], low[0], scale[0], index, dtype, group, rows)[None]
        if name not in KEYS:
            return int4_values(*(gather(buffers[f"{name}{part}"], index) for part in ("", ".low", ".scale")))
        residual = buffers[f"{name}.residual"]
        groups = index // residual.size(1)
        values = int4_values(gather(buffers[name], index), gather(buffers[f"{name}.low"], groups),
                             gather(buffers[f"{name}.scale"], groups))
        # the slots of the group being filled are the residual's, in full precision
        start, filled = buffers[f"{name}.filling"][0, 0], buffers[f"{name}.filling"][0, 1]
        fresh = ((index >= start) & (index < start + filled)).view(1, -1, *[1] * (values.dim() - 2))
        within = (index - start).clamp(0, residual.size(1) - 1)  # (S,): its place in the residual
        return torch.where(fresh, wide(residual[:, within]), values)


# -----------------------------------------------------------------------------
# The fast reads: a step's two products over an entry's codes, each the dequantised equation's

def grouped(x):
    """An entry (B, S, d) as one group of heads, (B, S, 1, d); (B, S, G, d) as it is."""
    return x.unsqueeze(2) if x.dim() == 3 else x


def positions_last(x):
    """An entry's slots (B, n, *rows, d) as quant.c's loops take them, (B, rows, d, n): a view, positions
    contiguous where it lies position-last."""
    return x.flatten(2, -2).permute(0, 2, 3, 1)


def dot_in_c(x, dot):
    """Codes.dot's result (B, n, *rows) in x's dtype, of x (B, n, *rows, d) lying position-last, from
    dot(b, x_b) (rows, n) fp32 for each sequence b, x_b its x (rows, d, n)."""
    x_rows = positions_last(x)
    out = torch.stack([dot(b, x_rows[b]) for b in range(x.size(0))])  # (B, rows, n)
    return out.transpose(1, 2).reshape(x.shape[:-1]).to(x.dtype)


def held_order(x):
    """A POSITION_LAST entry's buffer (B, L, [G,] d) as it lies in memory, by group: (B, G, d, L)."""
    x = x.permute(0, *range(2, x.dim()), 1)
    return x.unsqueeze(1) if x.dim() == 3 else x


@torch.compiler.disable  # inductor's lowering of the kernel refuses inputs it has not stored: run as it is
def int8_matmul(a, codes, scale, dtype):
    """a (M, K) times int8 codes (N, K) with a scale per row (N,): a @ (codes * scale[:, None]).T, (M, N),
    in bf16 or fp16 (dtype's) by PyTorch's weight-only int8 kernel (gpt-fast's), which converts the codes
    inside its dot products, over a K of whole 16s (past them its vector loop reads beyond the rows)."""
    return torch.ops.aten._weight_int8pack_mm(a.to(dtype).contiguous(), codes.contiguous(),
                                              scale.to(dtype).contiguous())


def int8_kernel_takes(dtype, K):
    """Whether int8_matmul runs in dtype over rows of K codes."""
    return dtype in (torch.bfloat16, torch.float16) and K % 16 == 0


def grouped_int8_matmul(a, codes, scale, dtype):
    """Each group's rows by its own codes: a (B, G, M, K), codes (B, G, N, K) int8, scale (B, G, N) ->
    (B, G, M, N), a[b, g] @ (codes[b, g] * scale[b, g, :, None]).T. Where int8_matmul takes them and a
    sequence's codes lie as one (G N, K) matrix, one call of every group's rows by all of it, (G M, G N), of
    which group g keeps its own block: G times the products in one call that reads the codes once, where a
    call per group costs more in calls than in products (one new token's rows are few, M: a head's).
    Elsewhere (fp32, fp64, a K past whole 16s) the kernel's own loop is five to ten times slower than
    converting the codes to a's dtype (fp32, or the tests' fp64) a few of N's rows at a time (about 1 MB,
    at least a row of every group's) and multiplying them group by group, the scale applied to the
    products: that."""
    B, G, M, K = a.shape
    N = codes.size(2)
    if not int8_kernel_takes(dtype, K):
        a, rows = wide(a.to(dtype)), max(1, 2**18 // (B * G * K))
        return torch.cat([(a @ codes[:, :, n:n + rows].to(a.dtype).transpose(-1, -2))
                          * scale[:, :, None, n:n + rows].to(a.dtype) for n in range(0, N, rows)], dim=-1)
    out = []
    for b in range(B):
        if codes[b].is_contiguous():
            rows, every_code = a[b].reshape(G * M, K), codes[b].view(G * N, K)
            every = int8_matmul(rows, every_code, scale[b].reshape(G * N), dtype)  # (G M, G N)
            out.append(every.view(G, M, G, N).diagonal(dim1=0, dim2=2).permute(2, 0, 1))  # (G, M, N)
        else:
            out.append(torch.stack([int8_matmul(a[b, g], codes[b, g], scale[b, g], dtype) for g in range(G)]))
    return torch.stack(out)


class Codes:
    """The first S slots of a quantised cache's entry, as a step that reads codes sees it (decode.py's
    CODE_STEPS): logically (B, S, *shape), what load would give, held as the storage holds it. A step asks
    for two products, by heads g of q and of the entry (an entry (B, S, d) is one group):

        scores(q):       q (B, G, M, d) -> (B, G, M, S), q_{g,m} . x_{s,g}
        weighted_sum(p): p (B, G, M, S) -> (B, G, M, d), sum_s p_{g,m,s} x_{s,g}

    and dot(x, start, stop), x (B, n, *shape) -> (B, n, *shape[:-1]): x . x_s over the last dim for the
    slots start..stop-1, which may take x in place (a chunk's own product). Here each by the dequantising
    read a chunk of slots at a time (values: load's own dequantisation of the chunk), converted, used and
    dropped while in the processor's cache; the storages' subclasses read the codes in a kernel where one
    fits."""

    chunk_bytes = 2**22  # a chunk's dequantised values

    def __init__(self, cache, buffers, name, S, dtype):
        self.cache, self.buffers, self.name, self.S, self.dtype = cache, buffers, name, S, dtype
        self.device = buffers[name].device
        packed = 2 if buffers[name].dtype == torch.uint8 else 1  # int4: two codes a byte
        self.shape = (buffers[name].size(0), S, *buffers[name].shape[2:-1], packed * buffers[name].size(-1))
        self.slot_numel = math.prod(self.shape[2:])

    def in_c(self, dtype):
        """Whether quant.c reads these codes for a step in dtype (the module's in_c)."""
        return in_c(dtype, self.buffers[self.name], self.buffers[f"{self.name}.scale"])

    @property
    def dot_position_last(self):
        """Whether dot reads x best with its positions contiguous (x.stride(1) == 1): as the codes lie,
        where C reads them."""
        return self.buffers[self.name].stride(1) == 1 and self.in_c(self.dtype)

    def values(self, start, stop):
        """Slots start..stop-1 as load gives them, (B, n, *shape) in the entry's dtype."""
        index = self.cache.slot_index(start, stop, self.device)
        return self.cache.load_entry(self.buffers, self.name, index).to(self.dtype)

    def chunks(self):
        step = max(1, self.chunk_bytes // (4 * self.buffers[self.name].size(0) * self.slot_numel))
        return [(start, min(start + step, self.S)) for start in range(0, self.S, step)]

    def scores(self, q):
        return torch.cat([torch.einsum("bgmd,bsgd->bgms", q, grouped(self.values(a, b)))
                          for a, b in self.chunks()], dim=-1)

    def weighted_sum(self, p):
        y = 0
        for a, b in self.chunks():
            y = y + torch.einsum("bgms,bsgd->bgmd", p[..., a:b], grouped(self.values(a, b)))
        return y

    def dot(self, x, start, stop):
        return (x * self.values(start, stop)).sum(-1)


class Int8Codes(Codes):
    """Int8KVCache's codes c with a scale s_t per row: a row is s_t c_t, so q . (s_t c_t) = s_t (q . c_t)
    and sum_t p_t s_t c_t = (p * s) . C: the scale moves onto the scores or the weights, and the codes go
    into int8_matmul as they lie, a HEAD_MAJOR or row entry's scores, a POSITION_LAST one's weighted
    sums (the other product of each, the chunked read)."""

    def __init__(self, cache, buffers, name, S, dtype):
        super().__init__(cache, buffers, name, S, dtype)
        self.codes = buffers[name][:, :S]  # (B, S, *shape) int8
        self.scale = buffers[f"{name}.scale"][:, :S, ..., 0]  # (B, S, *shape[:-1])

    def scores(self, q):
        if self.name in POSITION_LAST:
            return super().scores(q)
        codes = grouped(self.codes).transpose(1, 2)  # (B, G, S, d)
        scale = self.scale.reshape(*codes.shape[:1], -1, codes.size(1)).transpose(1, 2)  # (B, G, S)
        return grouped_int8_matmul(q, codes, scale, q.dtype).to(q.dtype)

    def weighted_sum(self, p):
        if self.name not in POSITION_LAST:
            return super().weighted_sum(p)
        codes = held_order(self.buffers[self.name])  # (B, G, d, L)
        B, G, M, S = p.shape
        weights = p * self.scale.reshape(B, S, -1).transpose(1, 2).unsqueeze(2)  # (B, G, M, S): p * s
        # over all L slots held, those past S weighted 0: a kernel reads its rows whole
        weights = torch.nn.functional.pad(weights, (0, codes.size(-1) - S))
        ones = torch.ones(codes.shape[:3], dtype=weights.dtype, device=p.device)
        return grouped_int8_matmul(weights, codes, ones, p.dtype).to(p.dtype)

    def dot(self, x, start, stop):  # x . (s_t c_t) = s_t (x . c_t); x, a chunk's own, taken in place
        if self.dot_position_last and x.stride(1) == 1:  # in C, x position-last as the codes lie
            codes = positions_last(self.codes[:, start:stop])  # (B, rows, d, n)
            scale = self.scale[:, start:stop].flatten(2)  # (B, n, rows)
            return dot_in_c(x, lambda b, x_b: quant_c.int8_key_dot(x_b, codes[b], scale[b]))
        return x.mul_(self.codes[:, start:stop]).sum(-1) * self.scale[:, start:stop]


class Int4Codes(Codes):
    """Int4KVCache's codes, two a byte (channels i and d/2 + i: int4_codes). An entry held per token
    is x_t = c_t s_t + m_t, so q . x_t = s_t (q . c_t) + m_t sum(q) and sum_t p_t x_t = (p * s) . C + p . m:
    the first and the second half's codes, each one mask or shift of the packed bytes (int8, 0..15), go
    into int8_matmul. A key entry, per channel over slot groups (KIVI), is x_t = c_t * s_g + m_g for the
    group g of slot t, so q . x_t = (q * s_g) . c_t + q . m_g: the scales move into the query, a group at a
    time, over a chunk of groups' codes converted in the processor's cache; the slots of the group being
    filled score from the residual, in full precision. On a CPU, quant.c's loops do the same products
    (in_c), a key entry's and a value's held position-last (INT4_POSITION_LAST)."""

    def __init__(self, cache, buffers, name, S, dtype):
        super().__init__(cache, buffers, name, S, dtype)
        self.packed = buffers[name]  # (B, L, *shape[:-1], d/2) uint8, L padded to whole groups for a key
        self.low, self.scale = buffers[f"{name}.low"], buffers[f"{name}.scale"]

    def token_low_scale(self, B, S, G):  # a per-token entry's m_t, s_t for every head, (B, S, G) each
        return [wide(x[:, :S].expand(B, S, *self.packed.shape[2:-1], 1).reshape(B, S, G))
                for x in (self.low, self.scale)]

    def scores(self, q):
        if self.name in KEYS:
            return self.key_scores(q)
        if self.name in POSITION_LAST:
            return super().scores(q)
        B, G, M, _ = q.shape
        codes = grouped(self.packed)[:, :self.S].transpose(1, 2)  # (B, G, S, d/2)
        low, scale = (x.transpose(1, 2) for x in self.token_low_scale(B, self.S, G))  # (B, G, S) each
        h = codes.size(-1)
        first, second = (codes & 15).view(torch.int8), (codes >> 4).view(torch.int8)  # the halves
        out = (grouped_int8_matmul(q[..., :h], first, scale, q.dtype)
               + grouped_int8_matmul(q[..., h:], second, scale, q.dtype)
               + wide(q).sum(-1, keepdim=True) * low.unsqueeze(2))  # (B, G, M, S)
        return out.to(q.dtype)

    def weighted_sum(self, p):
        if self.name not in POSITION_LAST:
            return super().weighted_sum(p)
        B, G, M, S = p.shape
        packed = held_order(self.packed)  # (B, G, d/2, L)
        if self.in_c(p.dtype):
            low, scale = (x[:, :S].reshape(B, S, -1).expand(B, S, G) for x in (self.low, self.scale))
            return torch.stack([quant_c.int4_weighted_sum(p[b], packed[b, ..., :S], low[b], scale[b])
                                for b in range(B)]).to(p.dtype)  # (B, G, M, d)
        low, scale = self.token_low_scale(B, S, G)
        weights = wide(p) * scale.transpose(1, 2).unsqueeze(2)  # (B, G, M, S): p * s
        weights = torch.nn.functional.pad(weights, (0, packed.size(-1) - S))  # slots past S weighted 0
        shift = wide(p) @ low.transpose(1, 2).unsqueeze(-1)  # (B, G, M, 1): p . m
        ones = torch.ones(packed.shape[:3], dtype=weights.dtype, device=p.device)
        out = torch.cat([grouped_int8_matmul(weights, half.view(torch.int8), ones, p.dtype)
                         for half in (packed & 15, packed >> 4)], dim=-1)  # (B, G, M, d)
        return (out + shift).to(p.dtype)

    def dot(self, x, start, stop):
        """A key entry's: x . (c_t * s_g + m_g), the codes of the whole groups that slots start..stop-1 span
        converted with their group's scale and low (no slot gathered), x taken in place (a chunk's own);
        then the slots of the group being filled (at most Gs) again, from the residual."""
        if self.name not in KEYS:
            return super().dot(x, start, stop)
        residual = self.buffers[f"{self.name}.residual"]  # (B, Gs, *shape)
        Gs = residual.size(1)
        filling = self.buffers[f"{self.name}.filling"]
        first, filled = filling[0, 0], filling[0, 1]
        a, b = start // Gs, -(-stop // Gs)  # the groups spanned
        B = x.size(0)
        if self.in_c(x.dtype) and x.stride(1) == 1:  # x position-last, as the codes lie
            packed = positions_last(self.packed[:, start:stop])  # (B, rows, d/2, n)
            low, scale = (t[:, a:b].flatten(2, -2) for t in (self.low, self.scale))  # (B, groups, rows, d)
            return dot_in_c(x, lambda i, x_i: quant_c.int4_key_dot(
                x_i, packed[i], low[i], scale[i], Gs, start, residual[i], int(first), int(filled)))
        place = torch.arange(Gs, device=x.device)
        slots = (first + place - start).clamp(0, stop - start - 1)  # (Gs,): the residual's slots in x
        rows = x[:, slots]  # (B, Gs, *shape): before x is taken
        codes = self.packed[:, a * Gs:b * Gs].reshape(B, b - a, Gs, *self.packed.shape[2:])
        codes = torch.cat((codes & 15, codes >> 4), dim=-1)  # (B, groups, Gs, *shape) uint8
        low, scale = self.low[:, a:b].unsqueeze(2), self.scale[:, a:b].unsqueeze(2)  # (B, groups, 1, *shape)
        values = torch.addcmul(low, codes.to(x.dtype), scale)
        out = x.mul_(values.flatten(1, 2)[:, start - a * Gs:stop - a * Gs]).sum(-1)  # (B, n, *shape[:-1])
        fresh = (place < filled) & (first + place >= start) & (first + place < stop)
        from_residual = (rows * residual.to(x.dtype)).sum(-1)  # (B, Gs, *shape[:-1])
        # a fresh slot's sum replaced by adding the difference: the others (clamped onto one slot) add 0
        change = torch.where(fresh.view(1, Gs, *[1] * (out.dim() - 2)), from_residual - out[:, slots], 0)
        return out.index_put((torch.arange(out.size(0), device=x.device)[:, None], slots[None]), change,
                             accumulate=True)

    def key_scores(self, q):
        B, G, M, d = q.shape
        residual = grouped(self.buffers[f"{self.name}.residual"])  # (B, Gs, G, d)
        Gs, n = residual.size(1), -(-self.S // residual.size(1))  # slots a group, groups read
        if self.in_c(q.dtype):
            codes = held_order(self.packed)[..., :self.S]  # (B, G, d/2, S)
            low, scale = (x[:, :n].reshape(B, n, G, d) for x in (self.low, self.scale))
            first, filled = (int(x) for x in self.buffers[f"{self.name}.filling"][0])
            return torch.stack([quant_c.int4_key_scores(q[b], codes[b], low[b], scale[b], Gs, residual[b],
                                                        first, filled) for b in range(B)]).to(q.dtype)
        packed = grouped(self.packed).transpose(1, 2)  # (B, G, L, d/2)
        low, scale = (grouped(x[:, :n]).permute(0, 2, 1, 3).unsqueeze(3) for x in (self.low, self.scale))
        q_low = (wide(q.unsqueeze(2)) * wide(low)).sum(-1, keepdim=True)  # (B, G, n, M, 1): q . m_g
        q_scaled = (q.unsqueeze(2) * scale.to(q.dtype))  # (B, G, n, M, d): q * s_g
        per = max(1, self.chunk_bytes // (4 * B * G * Gs * d))  # groups a chunk
        out = []
        for a in range(0, n, per):
            b = min(n, a + per)
            codes = packed[:, :, a * Gs:b * Gs].reshape(B, G, b - a, Gs, d // 2)
            first, second = (codes & 15).to(q.dtype), (codes >> 4).to(q.dtype)  # the halves' codes
            qs = q_scaled[:, :, a:b]
            h = first.size(-1)
            # (B, G, k, M, Gs): each group's slots by its scaled query
            s = qs[..., :h] @ first.transpose(-1, -2) + qs[..., h:] @ second.transpose(-1, -2)
            out.append((s + q_low[:, :, a:b].to(q.dtype)).transpose(2, 3).flatten(-2))  # (B, G, M, k Gs)
        scores = torch.cat(out, dim=-1)[..., :self.S]
        filling = self.buffers[f"{self.name}.filling"]
        start, filled = filling[0, 0], filling[0, 1]
        index = torch.arange(self.S, device=q.device)
        fresh = (index >= start) & (index < start + filled)
        within = (index - start).clamp(0, Gs - 1)  # (S,): its place in the residual
        from_residual = torch.einsum("bgmd,bsgd->bgms", q, residual.to(q.dtype))[..., within]
        return torch.where(fresh, from_residual, scores)


CACHES = {"none": RingKVCache, "int8": Int8KVCache, "int4": Int4KVCache}


def cache_class(kv_quant):
    """The cache class of a --kv_quant name, or a ValueError of one line."""
    if kv_quant not in CACHES:
        raise ValueError(f"--kv_quant={kv_quant!r}: must be one of {', '.join(CACHES)}")
    return CACHES[kv_quant]
