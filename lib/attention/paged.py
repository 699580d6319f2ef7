"""
A paged cache (vLLM's PagedAttention, Kwon et al. 2023): the KV cache of many sequences at once, within
one byte budget, for every variant, layout (layout.py) and storage (quant.py).

The entries live in one pool of blocks of `block_size` slots, which every layer that owns entries draws
from (a layer that reads another's keys holds none): a block holds block_size consecutive positions of
one sequence in one layer. A sequence has a block table per owner layer, its blocks in the order of its
positions, so that its position p in that layer lives in slot p % block_size of block table[p //
block_size]. Blocks are taken as a sequence grows (grow, which refuses what the pool lacks), all of them
given back when it ends (release), and in a layer whose readers all have windows (ring.py's span: the
widest of them) a block goes back as soon as its last position has fallen out of that span.

The pool is a storage of ring.RingKVCache's kind with one row of n_blocks * block_size slots: a slot of
the pool is slot (block, offset), and the storage's allocate, store and load make, write and read it as
they would any cache's slots. So paging and storage are two choices: paged_cache_class(storage) is the
paged cache over any of quant.CACHES, one class made of the two. A storage that quantises the entries
that make keys (quant.KEYS) over groups of `group` consecutive slots (quant.Int4KVCache) gets blocks of
`group` slots, those entries of each stored whole once it is full: until then they wait in the
sequence's `tail`, in full precision (KIVI's residual, one for each sequence), and reads of them come
from there; its other entries are stored as they come.

Sequences whose contexts begin alike share the blocks of that beginning (nano-vllm's block hashes, vLLM's
prefix caching): the same tokens at the same positions leave the same entries, so a block a sequence has
written whole can hold another's too. publish makes a sequence's written blocks findable by their tokens
and all the tokens before them; attach gives a new sequence the longest run of them that its context
begins with, short of its last token; a block goes back to the pool when the last sequence holding it lets
it go, and is no longer found from then on.

A forward runs the sequences select chose, each at its own position (model.py's row_positions): row b's
T new tokens are its positions lengths[b]..lengths[b] + T - 1, and its queries attend over its own
positions alone, gathered from its blocks, as ring.visible of each row's positions allows; one token a
row goes through its variant's exact single-token step (decode.py) where that step takes a row's mask.
"""

import math

import torch

from lib.attention.decode import gqa_step, lrkv_step, mla_step, step_for
from lib.attention import quant_c
from lib.attention.quant import KEYS, in_c
from lib.attention.ring import RingKVCache, visible

# The single-token steps that one token a row decodes by, whose scores are (B, H, S), so that a mask
# (B, 1, S) gives each row its own positions: LRKV's and MLA's, which build no cached position's key
# (decode.py), where the plain path rebuilds them all; and on a CPU, MHA's, GQA's and MQA's, whose softmax
# written out for one query (decode.reference_step) costs half of SDPA's kernel with a mask there (on a
# GPU, SDPA's fused kernel). Every other variant decodes by the plain path below
ROW_MASK_STEPS = {lrkv_step, mla_step}
CPU_ROW_MASK_STEPS = ROW_MASK_STEPS | {gqa_step}
# The buckets of those steps' shapes (attend): rows and positions read rounded up to a multiple of each
ROW_BUCKET, POSITION_BUCKET = 2, 32


def bucket(n, size):
    """n rounded up to a multiple of size; below size, to a power of two (a single row stays one)."""
    return -(-n // size) * size if n > size else 1 << (n - 1).bit_length()


class PagedKVCache(RingKVCache):
    """A pool of blocks within budget bytes (the module's docstring); sequences are any hashable ids."""

    # a quantised storage's entries held slot by slot, each slot's numbers contiguous: attend gathers a
    # row's slots, where the orders of quant.py's code reads (a channel's positions contiguous) would
    # scatter every slot's numbers across the pool
    position_last = head_major = ()

    def __init__(self, model, budget, dtype=None, device=None, block_size=16):
        # whole: blocks stored whole once full (a storage with key groups: its group is the block)
        self.whole = getattr(self, "group", None) is not None
        self.block_size, self.paged = self.group if self.whole else block_size, False  # paged: pool made
        block_size = self.block_size
        dtype, device = dtype or model.wte.weight.dtype, device or model.rope.device
        super().__init__(model, 1, model.config.block_size, dtype, device)  # every layer empty, then the pool
        shapes = {tuple(sorted(self.sources[owner].cache_shapes().items())) for owner in self.sources}
        if len(shapes) > 1:
            raise ValueError("a paged cache pools layers that cache entries of the same shapes")
        # Key groups are a storage's meaning: the pages group positions, a window's ring (sample.py's path)
        # its slots, which are the same groups only where the ring holds whole groups
        for owner, span in self.span.items():
            if self.whole and span < self.max_len and span % block_size:
                raise ValueError(f"layer {owner}'s window keeps {span} positions, which a ring quantises in "
                                 f"other key groups than this cache's of {block_size}: a window of a "
                                 f"multiple of {block_size}, or another storage")
        shapes = dict(shapes.pop())
        # a block's bytes: what one more block adds to the storage's buffers (not its fixed residual)
        self.block_bytes = (sum(buf.nbytes for buf in self.allocate(shapes, 2 * block_size, "meta").values())
                            - sum(buf.nbytes for buf in self.allocate(shapes, block_size, "meta").values()))
        self.n_blocks = budget // self.block_bytes
        if self.n_blocks == 0:
            raise ValueError(f"a KV budget of {budget} bytes holds no block of {block_size} positions "
                             f"({self.block_bytes} bytes)")
        self.paged = True
        pool = self.allocate(shapes, self.n_blocks * block_size, device)
        for owner in self.sources:
            self.layers[owner] = pool  # every owner's store and load reach the one pool
        self.free = list(range(self.n_blocks - 1, -1, -1))  # blocks not held, popped from the end
        self.tables, self.lengths = {}, {}  # sequence: {owner: [block, or None once freed]}, positions held
        # sequence: {owner: (positions,) the pool's slot of each position, -1 where no block holds it}: its
        # table spelt out slot by slot (whole blocks), so that a forward reads its rows' slots by slicing
        self.slot_maps = {}
        self.block_slots = torch.arange(self.n_blocks * block_size).view(self.n_blocks, block_size)
        self.tails = {}  # with whole blocks, sequence: {owner: {name: (1, block_size, *shape)}}, its newest
        # a tail weighs on the budget as the blocks it would fill, taken from the pool with its sequence's
        # first (reserved, given back with its last)
        tail_bytes = block_size * sum(torch.Size(shape).numel() for name, shape in shapes.items()
                                      if name in KEYS) * dtype.itemsize * len(self.sources)
        self.tail_blocks = -(-tail_bytes // self.block_bytes) if self.whole else 0
        self.reserved = {}  # sequence: the blocks its tails take
        self.rows = []
        self.holders = {}  # block: how many sequences hold it (several: a shared prefix's)
        # published blocks: (the node before, a block's tokens) -> (node, {owner: block}), a node numbered
        # once and never again, so that a key never names blocks other than the ones published under it
        self.prefixes, self.published, self.nodes = {}, {}, 0  # published: sequence -> (blocks, last node)
        self.prefix_of = {}  # block: its key in prefixes

    def length(self, layer):  # the pool's slots for every owner; none before the pool is made
        return self.n_blocks * self.block_size if self.paged and layer in self.sources else 0

    # Sequences and their blocks

    def blocks_needed(self, seq, T):
        """The blocks seq takes to hold T more positions, in all its owner layers."""
        last = self.lengths.get(seq, 0) + T - 1  # the last position it will hold
        held = self.tables.get(seq, {})
        tails = 0 if seq in self.tables else self.tail_blocks
        return tails + sum(last // self.block_size + 1 - len(held.get(owner, [])) for owner in self.sources)

    def grow(self, seq, T):
        """Take the blocks for seq's next T positions (a new seq starts at 0); False, taking none, where the
        pool has fewer free."""
        if self.blocks_needed(seq, T) > len(self.free):
            return False
        if seq not in self.tables:
            self.start(seq, {owner: [] for owner in self.sources})
        last = self.lengths[seq] + T - 1
        for owner, blocks in self.tables[seq].items():
            while len(blocks) <= last // self.block_size:
                blocks.append(self.free.pop())
                self.holders[blocks[-1]] = 1
                self.map_block(seq, owner, len(blocks) - 1, blocks[-1])
        return True

    def start(self, seq, table):
        """A new sequence holding table's blocks ({owner: [block]}, whole), its tails' blocks reserved."""
        self.reserved[seq] = [self.free.pop() for _ in range(self.tail_blocks)]
        self.tables[seq], self.lengths[seq] = table, len(next(iter(table.values()))) * self.block_size
        # whole blocks (the last may pass max_len), and a bucket of positions past them (attend's shapes)
        whole = -(-self.max_len // self.block_size) * self.block_size + POSITION_BUCKET
        self.slot_maps[seq] = {owner: torch.full((whole,), -1) for owner in table}
        for owner, blocks in table.items():
            for i, block in enumerate(blocks):
                self.map_block(seq, owner, i, block)

    def map_block(self, seq, owner, i, block):
        """seq's i-th block in owner is block (None: none, freed), in its slot map."""
        bs = self.block_size
        self.slot_maps[seq][owner][i * bs:(i + 1) * bs] = -1 if block is None else self.block_slots[block]

    def let_go(self, block):
        """A sequence no longer holds block: back to the pool, and no longer found, once none holds it."""
        self.holders[block] -= 1
        if self.holders[block] == 0:
            del self.holders[block]
            self.free.append(block)
            if block in self.prefix_of:  # the blocks published with it are not found either
                for other in self.prefixes.pop(self.prefix_of[block])[1].values():
                    del self.prefix_of[other]

    def release(self, seq):
        """seq has ended (or is preempted): all its blocks let go (back to the pool unless shared)."""
        for blocks in self.tables.pop(seq, {}).values():
            for block in blocks:
                if block is not None:
                    self.let_go(block)
        self.lengths.pop(seq, None)
        self.slot_maps.pop(seq, None)
        self.tails.pop(seq, None)
        self.published.pop(seq, None)
        self.free.extend(self.reserved.pop(seq, []))

    def publish(self, seq, tokens):
        """seq's blocks written whole made findable by attach, each under its tokens and the node of the block
        before it; tokens: seq's context, of which the cache holds the first lengths[seq]. A block that a
        window has given back ends what can be found."""
        bs, table = self.block_size, self.tables[seq]
        done, node = self.published.get(seq, (0, -1))
        for i in range(done, min(len(tokens), self.lengths[seq]) // bs):
            owned = {owner: blocks[i] for owner, blocks in table.items()}
            if None in owned.values():
                break
            key = (node, tuple(tokens[i * bs:(i + 1) * bs]))
            if key not in self.prefixes:  # else another's blocks of the same tokens (this seq's, attached)
                self.prefixes[key] = (self.nodes, owned)
                self.prefix_of.update((block, key) for block in owned.values())
                self.nodes += 1
            node, done = self.prefixes[key][0], i + 1
        self.published[seq] = done, node

    def attach(self, seq, tokens):
        """A new seq whose context is tokens begins with the longest run of published blocks that its tokens
        begin with, short of the last token (whose logits a forward must still give), shared: the positions
        they hold (0 where none, or where the pool lacks the blocks of its tails)."""
        bs, node, run = self.block_size, -1, []
        for i in range((len(tokens) - 1) // bs):
            found = self.prefixes.get((node, tuple(tokens[i * bs:(i + 1) * bs])))
            if found is None:
                break
            node, owned = found
            run.append(owned)
        if not run or len(self.free) < self.tail_blocks:
            return 0
        for owned in run:
            for block in owned.values():
                self.holders[block] += 1
        self.start(seq, {owner: [owned[owner] for owned in run] for owner in self.sources})
        self.published[seq] = len(run), node
        return len(run) * bs

    def held_bytes(self):
        """The bytes of the blocks sequences hold now."""
        return (self.n_blocks - len(self.free)) * self.block_bytes

    def select(self, seqs):
        """The sequences of the next forward, its rows in this order, each grown (grow) for its T new tokens
        beforehand."""
        self.rows = list(seqs)

    # The forward: each row at its own positions

    def row_positions(self, columns):
        """Each row's positions from its length on, columns (T,) counted from there: (B, T)."""
        lengths = torch.tensor([self.lengths[seq] for seq in self.rows], device=columns.device)
        return lengths[:, None] + columns

    def next_rope(self, T):
        here = self.row_positions(torch.arange(T))  # (B, T)
        if int(here.max()) >= self.max_len:
            raise ValueError(f"a sequence of the paged cache holds {self.max_len} tokens, "
                             f"{int(here.max()) + 1} were asked for")
        return self.rope[here.to(self.rope.device)]  # (B, T, rope_dim)

    def row_slots(self, rows, owner, start, stop):
        """The pool's slots (B, stop - start) of rows' positions start..stop-1 in owner, -1 where a row's
        block holds none (freed out of its window, or past its last)."""
        return torch.stack([self.slot_maps[seq][owner][start:stop] for seq in rows])

    def attend(self, attn, q, x, rope):
        """attn's tokens x (B, T, d), each row's next T positions, leave their entries in their rows' blocks
        (an owner layer); the queries q attend over each row's positions that their window keeps, as
        visible allows."""
        layer, owner = attn.layer, self.kv_source[attn.layer]
        B, T = x.shape[:2]
        here = self.row_positions(torch.arange(T))  # (B, T)
        firsts = [self.lengths[seq] for seq in self.rows]  # each row's first new position
        new = torch.stack([self.slot_maps[seq][owner][n:n + T]
                           for seq, n in zip(self.rows, firsts)])  # (B, T): the new tokens' slots
        if owner == layer and self.whole:
            self.store_whole(owner, new, here, attn.cache_entries(x, rope))
        elif owner == layer:
            entries = attn.cache_entries(x, rope)
            self.store(owner, new.flatten().to(x.device),
                       {name: e.reshape(1, B * T, *e.shape[2:]) for name, e in entries.items()})
        window, span = self.windows[layer], self.span[owner]
        end = max(firsts) + T
        # from the first position that any row's first query may see in the owner's span
        start = 0 if span == self.max_len else max(0, min(firsts) - span + 1)
        source = self.sources[owner]
        step = step_for(attn, source) if T == 1 else None
        row_steps = CPU_ROW_MASK_STEPS if q.device.type == "cpu" else ROW_MASK_STEPS
        in_place = step is gqa_step and self.reads_in_place(owner, q)  # no slot gathered: no GEMM either
        rows, S = self.rows, end - start
        if step in row_steps and not in_place:  # one token a row: its variant's exact step, on shapes of a
            # few buckets, where the GEMMs of a shape met for the first time cost a CPU twice those of one
            # met before (oneDNN makes each shape's kernel once): the rows padded by copies of the first,
            # dropped after, and the positions by masked ones past the end
            rows = rows + rows[:1] * (bucket(B, ROW_BUCKET) - B)
            S = bucket(S, POSITION_BUCKET)
            index = torch.tensor([*range(B)] + [0] * (len(rows) - B))
            here, new, q = here[index], new[index], q[index.to(q.device)]
        keys = torch.arange(start, start + S)  # (S,): the positions read
        slots = self.row_slots(rows, owner, start, start + S)  # (B, S)
        held = (slots >= 0) & (keys <= here[:, -1:])  # past a row's end: nothing there yet
        k_pos = torch.where(held, keys, -1).to(q.device)
        mask = visible(here.to(q.device), k_pos, window).unsqueeze(1)  # (B, 1, T, S)
        if in_place:
            return self.gqa_step_in_place(owner, q, torch.where(mask[:, 0, 0], slots, -1))
        # where a row holds no position, its newest entry, masked: a key RMS of 0 would make keys of 0 / 0
        slots = torch.where(held, slots, new[:, -1:])
        entries = {name: e.view(len(rows), -1, *e.shape[2:])
                   for name, e in self.load(owner, slots.flatten().to(x.device)).items()}
        if self.whole:
            entries = self.with_tails(rows, owner, keys, here, entries)
        # every row's positions start..start+S-1 (those past the context masked: any row will do)
        rope = self.rope[keys.clamp(max=self.max_len - 1).to(self.rope.device)]
        if step is gqa_step and self.reads_in_c(q, entries["k"]):  # int4's, dequantised: quant.c's loop
            # over them as they lie, a row's positions as slots of a pool of B S, those it does not see -1
            seen = torch.where(mask[:, 0, 0], torch.arange(k_pos.numel()).view(k_pos.shape), -1)
            return gqa_in_c(q, seen, *(entries[name].flatten(0, 1) for name in ("k", "v")))[:B]  # (B S, G, d)
        if step in row_steps:
            return step(source, q, entries, rope, mask[:, :, 0])[:B]  # mask (B, 1, S), scores (B, H, S)
        prompt = B == 1 and end == T and window is None  # a whole prompt at once: Attention.attend's causal
        k, v = source.cached_keys_values(rope, **entries)
        return attn.attend(q, k, v, None if prompt else mask)

    def reads_in_place(self, owner, q):
        """Whether MHA's, GQA's and MQA's one token a row reads owner's keys and values where they lie in the
        pool (gqa_step_in_place): a plain pool or an int8 one (int4's keys wait in tails), as reads_in_c."""
        return not self.whole and self.reads_in_c(q, self.layers[owner]["k"])

    @staticmethod
    def reads_in_c(q, k):
        """Whether quant.c's loop (paged_gqa_decode) reads keys k for queries q: on a CPU where it is built,
        k of fp32, bf16 or int8, and q short of fp64 (the tests' exact decodes)."""
        return k.dtype in (torch.float32, torch.bfloat16, torch.int8) and in_c(q.dtype, q, k)

    def gqa_step_in_place(self, owner, q, slots):
        """gqa_step's equation for one token a row over the slots (B, S) each row sees in owner's pool (-1:
        none), read where they lie: no slot gathered or dequantised (an int8 row s c: q . (s c) = s (q . c),
        and a weight times s onto the codes). q (B, 1, H, d) -> (B, 1, H, d)."""
        pool = {name: buf[0] for name, buf in self.layers[owner].items()}  # (n, G, d), scales (n, G, 1)
        scales = [pool[f"{name}.scale"][..., 0] if f"{name}.scale" in pool else None for name in ("k", "v")]
        return gqa_in_c(q, slots, pool["k"], pool["v"], *scales)

    def store_whole(self, owner, new, here, entries):
        """Each row's new entries {name: (B, T, *shape)} of positions here (B, T): those that make keys into
        its tail, and every block they fill, whole, from the tail into the pool (its slots in order, as the
        storage's groups fill); the others into their slots new (B, T)."""
        bs = self.block_size
        self.dtypes.setdefault(owner, {name: e.dtype for name, e in entries.items()})  # as store notes them
        B, T = here.shape
        device = next(iter(entries.values())).device
        self.store(owner, new.flatten().to(device),
                   {name: e.reshape(1, B * T, *e.shape[2:]) for name, e in entries.items()
                    if name not in KEYS})
        entries = {name: e for name, e in entries.items() if name in KEYS}
        if not entries:  # a variant with no entry that makes keys of KEYS' names: nothing waits in a tail
            return
        for b, seq in enumerate(self.rows):
            tail = self.tails.setdefault(seq, {}).setdefault(
                owner, {name: e.new_zeros(1, bs, *e.shape[2:], dtype=self.dtype)  # as Int4KVCache's residual
                        for name, e in entries.items()})
            first, T = int(here[b, 0]), here.size(1)
            for i in range(T):  # a block's part at a time
                if i and (first + i) % bs:
                    continue
                offset, n = (first + i) % bs, min(bs - (first + i) % bs, T - i)
                for name, e in entries.items():
                    tail[name][:, offset:offset + n] = e[b:b + 1, i:i + n]
                if offset + n == bs:  # full: stored whole
                    block = self.tables[seq][owner][(first + i) // bs]
                    slots = torch.arange(block * bs, (block + 1) * bs, device=device)
                    self.store(owner, slots, tail)

    def with_tails(self, rows, owner, keys, here, entries):
        """entries {name: (B, S, *shape)} of rows' positions keys (S,), those of each row's block not yet full
        written over from its tail, in place (a position a row does not hold is masked, whatever its slot
        gave)."""
        bs, first = self.block_size, int(keys[0])
        for b, (seq, end) in enumerate(zip(rows, (here[:, -1] + 1).tolist())):  # end: its positions after
            n = end % bs  # the positions of its block not yet full, from end - n on (none where n == 0)
            start = max(end - n, first)
            if n == 0 or start >= first + len(keys):
                continue
            for name, e in entries.items():
                if name in KEYS:
                    e[b, start - first:end - first] = self.tails[seq][owner][name][0, start - end + n:n]
        return entries

    def advance(self, T):
        """The rows have moved on by T: a windowed owner gives back each block whose last position has
        fallen out of its span (the next query, at position n, sees none at or before n - span)."""
        for seq in self.rows:
            self.lengths[seq] += T
            for owner, blocks in self.tables[seq].items():
                dead = (self.lengths[seq] - self.span[owner] + 1) // self.block_size  # blocks wholly before
                for i in range(min(dead, len(blocks))):
                    if blocks[i] is not None:
                        self.let_go(blocks[i])
                        blocks[i] = None
                        self.map_block(seq, owner, i, None)


def gqa_in_c(q, slots, k, v, k_scale=None, v_scale=None):
    """gqa_step's equation, softmax_t(q_h . k_{t,g} / sqrt(d)) v_{t,g} for query head h of key head g, by
    quant.c's loop over each row's slots (B, S) of k, v (n, G, d) (-1: a slot the row does not see), every
    number in fp32: q (B, 1, H, d) -> (B, 1, H, d)."""
    out = quant_c.paged_gqa_decode(q[:, 0], slots, k, v, k_scale, v_scale, 1 / math.sqrt(q.size(-1)))
    return out.to(q.dtype).unsqueeze(1)


def paged_cache_class(storage=RingKVCache):
    """The paged cache over storage (a class of quant.CACHES, or any RingKVCache storage): one class of the
    two, paging's methods before the storage's allocate, store and load."""
    if storage is RingKVCache:
        return PagedKVCache
    return type(f"Paged{storage.__name__}", (PagedKVCache, storage), {})


def blocks_for(cache, n, chunk):
    """The most blocks one sequence of n positions holds at once, prefilled chunk positions at a time: in a
    layer of span W, at most the blocks of its W + chunk latest positions; and its tails'."""
    bs, full = cache.block_size, math.ceil(n / cache.block_size)
    spans = sum(min(full, (cache.span[owner] + chunk) // bs + 2) for owner in cache.sources)
    return cache.tail_blocks + spans
