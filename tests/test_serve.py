"""Many sequences at once: rows at different positions through model.py's forward (ring.py's left-padded
rows) against each row alone; lib/attention/paged.py's paged cache and lib/attention/engine.py's continuous
batching against each prompt decoded alone with the plain cache, for every variant, layout and storage,
preempted too, and contexts that begin alike sharing their blocks; bad input in one line."""

import pytest
import torch

from lib.attention.decode import ExactKVCache, FixedKVCache
from lib.attention import quant_c
from lib.attention.engine import Engine
from lib.attention.layout import kv_cache_elements_per_token
from lib.attention.paged import PagedKVCache, blocks_for, bucket, paged_cache_class
from lib.attention.quant import Int4KVCache, Int8KVCache
from lib.attention.ring import RingKVCache
from model import VARIANTS
from references import TINY, tiny_model

LAYOUTS = {"plain": {}, "cla2": dict(cla=2), "window": dict(window=5, window_pattern="SL")}


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for n in lengths]


def left_padded(rows):
    """rows (lists of tokens) as idx (B, T), each left-padded with token 0, and each row's first column."""
    T = max(len(row) for row in rows)
    idx = torch.tensor([[0] * (T - len(row)) + row for row in rows])
    return idx, torch.tensor([T - len(row) for row in rows])


@pytest.mark.parametrize("attn", VARIANTS)
def test_rows_at_different_positions_decode_as_each_row_alone(attn):
    """Prompts of 3, 9 and 6 tokens left-padded into one batch, then 6 more tokens each, one a forward: every
    row's logits are those of the row decoded alone (fp32), with shared keys and with windows of 5 (which
    the longest row outgrows, and the ring wraps)."""
    rows, more = prompts([3, 9, 6]), torch.randint(0, TINY.vocab_size, (3, 6), generator=torch.Generator())
    idx, starts = left_padded(rows)
    for layout, knobs in LAYOUTS.items():
        model = tiny_model(attn, n_layer=4, **knobs)
        with torch.no_grad():
            cache = model.new_cache(3, idx.size(1) + 6, torch.float32, cache_class=RingKVCache)
            cache.starts = starts
            batched = [model(idx, cache=cache)[0][:, -1]]
            batched += [model(more[:, t:t + 1], cache=cache)[0][:, -1] for t in range(6)]
            for b, row in enumerate(rows):
                alone = model.new_cache(1, len(row) + 6, torch.float32, cache_class=RingKVCache)
                logits = [model(torch.tensor([row]), cache=alone)[0][0, -1]]
                logits += [model(more[b:b + 1, t:t + 1], cache=alone)[0][0, -1] for t in range(6)]
                torch.testing.assert_close(torch.stack([x[b] for x in batched]), torch.stack(logits),
                                           atol=1e-5, rtol=1e-5, msg=f"{layout} row {b}")


def test_the_single_token_steps_refuse_rows_at_different_positions():
    """decode.py's steps take one set of RoPE rows and one mask for the batch: its views refuse a ring of
    left-padded rows in one line, which then decodes by the plain cached path (above)."""
    model = tiny_model("lrkv")
    cache = model.new_cache(2, 8, torch.float32, cache_class=RingKVCache)
    cache.starts = torch.tensor([0, 2])
    for view in (ExactKVCache, FixedKVCache):
        with pytest.raises(ValueError, match="^rows at different positions [^\n]*$"):
            view(cache)


def alone(model, prompt, n, cache_class=RingKVCache, length=None):
    """prompt's n greedy tokens decoded alone: a prefill, then a token a forward, through a cache of
    cache_class in fp32, of length positions (default: the prompt's and n)."""
    cache = model.new_cache(1, length or len(prompt) + n, torch.float32, cache_class=cache_class)
    idx, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(idx, cache=cache)[0][0, -1].argmax()))
            idx = torch.tensor([[out[-1]]])
    return out


LENGTHS = [5, 23, 1, 40, 9]  # prompts of different lengths, two of them longer than a chunk of 16
NEW = 6


def serve(model, budget, storage=RingKVCache, new=NEW):
    engine = Engine(model, budget, storage, torch.float32, block_size=4, chunk=16)
    return engine.generate(prompts(LENGTHS), new), engine


@pytest.mark.parametrize("storage", [RingKVCache, Int8KVCache], ids=["plain", "int8"])
@pytest.mark.parametrize("attn", VARIANTS)
def test_every_request_decodes_as_its_prompt_alone(attn, storage):
    """Five prompts of 1 to 40 tokens through the engine (blocks of 4 positions, prefill chunks of 16):
    every request's greedy tokens are those of its prompt decoded alone through a cache of the same storage,
    with shared keys and with windows of 5 (whose blocks go back as they fall out of the window)."""
    for layout, knobs in LAYOUTS.items():
        model = tiny_model(attn, n_layer=2, block_size=64, **knobs)
        budget = model.kv_cache_bytes(len(LENGTHS), 64, torch.float32, storage)
        got, engine = serve(model, budget, storage)
        expected = [alone(model, prompt, NEW, storage) for prompt in prompts(LENGTHS)]
        assert got == expected, layout
        assert engine.stats["peak_in_flight"] > 1 and engine.cache.held_bytes() == 0, layout


class Int4Groups4(Int4KVCache):
    group = 4  # key groups, and so blocks, of 4 positions, which the tests' prompts fill


@pytest.mark.parametrize("attn", VARIANTS)
def test_int4_pages_its_key_groups_as_blocks(attn):
    """int4's keys quantised per channel over groups of 4 positions: the engine's blocks are the groups,
    each stored whole once full, the newest in the sequence's full-precision tail until then. Every
    request's greedy tokens are those of its prompt alone through an int4 cache of 64 positions (a
    multiple of the group, so that no group ends early at the cache's last slot), with and without
    shared keys. (A windowed ring's int4 groups run over its slots, the pages' over positions: they
    differ, and are not compared.)"""
    for layout, knobs in list(LAYOUTS.items())[:2]:
        model = tiny_model(attn, n_layer=2, block_size=64, **knobs)
        got, engine = serve(model, model.kv_cache_bytes(len(LENGTHS), 64, torch.float32), Int4Groups4)
        assert engine.cache.block_size == 4 and engine.cache.held_bytes() == 0, layout
        assert got == [alone(model, prompt, NEW, Int4Groups4, 64) for prompt in prompts(LENGTHS)], layout


def test_int4_pages_refuse_a_window_that_is_not_whole_key_groups():
    """A window's ring quantises int4 keys in groups of its slots, the pages in groups of positions: the
    same only for a window of whole groups, so the paged int4 cache refuses any other in one line (the
    ring and the engine would give two meanings of one storage), and takes one of whole groups."""
    model = tiny_model("mha", n_layer=2, block_size=64, window=6, window_pattern="SL")
    refusal = "^layer 0's window keeps 6 positions, which a ring quantises in other key groups than this "
    with pytest.raises(ValueError, match=refusal + "cache's of 4: [^\n]*$"):
        Engine(model, 10**6, Int4Groups4, torch.float32)
    Engine(tiny_model("mha", n_layer=2, block_size=64, window=8, window_pattern="SL"), 10**6, Int4Groups4)


@pytest.mark.parametrize("storage", [RingKVCache, Int8KVCache, Int4Groups4], ids=["plain", "int8", "int4"])
@pytest.mark.parametrize("attn", ["mha", "gqa", "lrkv", "mla"])
def test_a_decode_forward_of_bucketed_shapes_gives_every_rows_logits_alone(attn, storage):
    """One token a row through the single-token steps, their rows and positions padded to buckets (3 rows
    read as 4, at most 24 positions as 32): each row's logits are its own alone, to fp32's round-off, and
    the padding neither writes nor holds a slot."""
    assert [bucket(n, 4) for n in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 4, 8, 12]
    assert [bucket(n, 32) for n in (1, 17, 24, 32, 33)] == [1, 32, 32, 32, 64]
    model = tiny_model(attn, n_layer=2, block_size=64)
    cache = paged_cache_class(storage)(model, 10**6, torch.float32, block_size=4)
    contexts = prompts([5, 23, 9])
    with torch.no_grad():
        for seq, context in enumerate(contexts):  # each prompt alone, less its last token
            assert cache.grow(seq, len(context) - 1)
            cache.select([seq])
            model(torch.tensor([context[:-1]]), cache=cache)
        held = cache.held_bytes()
        for seq, context in enumerate(contexts):
            assert cache.grow(seq, 1)
        cache.select(range(len(contexts)))
        together = model(torch.tensor([[context[-1]] for context in contexts]), cache=cache)[0][:, -1]
        for row, context in enumerate(contexts):
            ring = model.new_cache(1, 64, torch.float32, cache_class=storage)
            alone_logits = model(torch.tensor([context]), cache=ring)[0][0, -1]
            torch.testing.assert_close(together[row], alone_logits, atol=1e-5, rtol=1e-5)
    assert cache.held_bytes() >= held and sorted(cache.lengths.values()) == sorted(map(len, contexts))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("attn", ["mha", "lrkv", "tpa"])
def test_the_pools_int4_read_in_c_is_pytorchs(attn, dtype, monkeypatch):
    """The paged pool's int4 slots (whole key groups, and entries per token of one row or two) read in one
    pass in C: bit for bit the values of PyTorch's dequantising read."""
    model = tiny_model(attn, n_layer=1, block_size=64).to(dtype)
    cache = paged_cache_class(Int4Groups4)(model, 10**6, dtype, block_size=4)
    torch.manual_seed(0)
    slots = torch.arange(32)  # eight whole groups of 4
    cache.store(0, slots, {name: torch.randn(1, 32, *shape, dtype=dtype)
                           for name, shape in model.blocks[0].attn.cache_shapes().items()})
    read = torch.randperm(32)[:20]
    in_c = cache.load(0, read)
    monkeypatch.setattr(quant_c, "library", lambda: None)
    for name, values in cache.load(0, read).items():
        assert in_c[name].dtype == values.dtype and torch.equal(in_c[name], values), name


def decode_once(model, storage, dtype, contexts):
    """The logits (B, vocab) of one decode forward of every context's last token, after each context less
    it prefilled alone, through a paged cache of storage in dtype (blocks of 4)."""
    cache = paged_cache_class(storage)(model, 10**6, dtype, block_size=4)
    with torch.no_grad():
        for seq, context in enumerate(contexts):
            assert cache.grow(seq, len(context) - 1)
            cache.select([seq])
            model(torch.tensor([context[:-1]]), cache=cache)
        for seq in range(len(contexts)):
            assert cache.grow(seq, 1)
        cache.select(range(len(contexts)))
        return model(torch.tensor([[context[-1]] for context in contexts]), cache=cache)[0][:, -1]


@pytest.mark.skipif(quant_c.library() is None, reason="quant.c is not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("storage", [RingKVCache, Int8KVCache], ids=["plain", "int8"])
@pytest.mark.parametrize("attn", ["mha", "gqa", "mqa"])
def test_mha_gqa_and_mqa_read_the_pool_in_place_as_the_gathered_step(attn, storage, dtype, monkeypatch):
    """One token a row of MHA, GQA and MQA reads the pool's keys and values where they lie (quant.c's
    paged_gqa_decode, each row its own slots): the logits of the gathered, dequantised step (gqa_step),
    plain and int8, fp32 and bf16, with shared keys and with windows of 5 that hide a row's oldest slots."""
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.05)
    for layout, knobs in LAYOUTS.items():
        model = tiny_model(attn, n_layer=2, block_size=64, **knobs).to(dtype)
        contexts = prompts([5, 23, 9, 14])
        calls = []
        in_place = PagedKVCache.gqa_step_in_place
        monkeypatch.setattr(PagedKVCache, "gqa_step_in_place", lambda *a: calls.append(1) or in_place(*a))
        read = decode_once(model, storage, dtype, contexts)
        assert len(calls) == model.config.n_layer, layout
        monkeypatch.setattr(PagedKVCache, "reads_in_place", lambda *a: False)
        gathered = decode_once(model, storage, dtype, contexts)
        torch.testing.assert_close(read, gathered, **tolerance, msg=layout)
        monkeypatch.undo()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_pools_int8_read_in_its_dtype_is_the_fp32_values_rounded_once(dtype):
    """The paged pool holds int8 entries slot by slot (each slot's numbers contiguous, for its gathers), and
    reads them in the cache's dtype: bit for bit the fp32 products c s rounded to that dtype."""
    model = tiny_model("mha", n_layer=1, block_size=64).to(dtype)
    cache = paged_cache_class(Int8KVCache)(model, 10**6, dtype, block_size=4)
    buffers = cache.layers[0]
    assert buffers["k"].is_contiguous() and buffers["v"].is_contiguous()  # a slot's numbers together
    torch.manual_seed(0)
    slots = torch.randperm(cache.n_blocks * 4)[:40]
    cache.store(0, slots, {name: torch.randn(1, 40, *shape, dtype=dtype)
                           for name, shape in model.blocks[0].attn.cache_shapes().items()})
    for name, got in cache.load(0, slots).items():
        codes, scale = buffers[name][0, slots], buffers[f"{name}.scale"][0, slots]
        assert got.dtype == dtype and torch.equal(got[0], (codes.float() * scale.float()).to(dtype)), name


@pytest.mark.parametrize("storage", [RingKVCache, Int8KVCache, Int4Groups4], ids=["plain", "int8", "int4"])
def test_a_context_of_no_whole_number_of_blocks_decodes_to_its_end(storage):
    """A context of 30 positions in blocks of 4 (its last block half past the context): requests that run
    to its last position still give their prompts' tokens alone."""
    model = tiny_model("lrkv", n_layer=2, block_size=30)
    engine = Engine(model, 10**6, storage, torch.float32, block_size=4, chunk=16)
    got = engine.generate(prompts([22, 9]), [8, 21])
    assert got == [alone(model, prompt, n, storage) for prompt, n in zip(prompts([22, 9]), [8, 21])]


@pytest.mark.parametrize("attn", ["mha", "lrkv", "mla"])
def test_a_full_pool_preempts_and_recomputes_to_the_same_tokens(attn):
    """A budget of the blocks that the longest request (40 + 16 tokens) needs, no more: requests wait and are
    preempted (their blocks freed, their context recomputed later), and still every request's tokens are
    its prompt's alone."""
    for layout, knobs in LAYOUTS.items():
        model = tiny_model(attn, n_layer=2, block_size=64, **knobs)
        probe = PagedKVCache(model, 10**6, torch.float32, block_size=4)
        got, engine = serve(model, blocks_for(probe, 40 + 16, 16) * probe.block_bytes, new=16)
        assert got == [alone(model, prompt, 16) for prompt in prompts(LENGTHS)], layout
        assert engine.stats["preemptions"] > 0, layout


def test_the_requests_with_the_most_tokens_to_decode_go_first():
    """Every request is there from the start, so the line orders them by their max_new_tokens, the most first,
    ties in the prompts' order (longest processing time first: the run does not end with a long request
    decoding alone); each still gives its prompt's tokens alone, back in the prompts' order."""
    model = tiny_model("mha", n_layer=2, block_size=64)
    engine, order = Engine(model, 10**6, RingKVCache, torch.float32, block_size=4, chunk=16), []
    select = engine.cache.select

    def recording(seqs):  # the order in which requests first go into a forward
        order.extend(seq for seq in seqs if seq not in order)
        select(seqs)

    engine.cache.select = recording
    news = [2, 6, 4, 6, 1]
    got = engine.generate(prompts(LENGTHS), news)
    assert order == [1, 3, 2, 0, 4]
    assert got == [alone(model, prompt, n) for prompt, n in zip(prompts(LENGTHS), news)]


# contexts that begin alike: two of a 13-token beginning and different ends, that beginning itself, one of
# its first 9 tokens, a copy of one of the others, and one of its own; and one whose second block of 4
# tokens is that of another (OTHER), after a first block of BEGINNING's: the same tokens after different
# ones make other entries, and are not shared
BEGINNING, OTHER = prompts([13], seed=1)[0], [9, 9, 9, 9, 4, 4, 4, 4, 1, 2]
SHARING = [BEGINNING + [3, 1], OTHER, BEGINNING + [7], BEGINNING, BEGINNING[:9] + [2, 2, 5],
           BEGINNING[:4] + OTHER[4:], BEGINNING + [3, 1], prompts([11], seed=2)[0]]


@pytest.mark.parametrize("storage", [RingKVCache, Int8KVCache, Int4Groups4], ids=["plain", "int8", "int4"])
@pytest.mark.parametrize("attn", ["mha", "lrkv", "mla"])
def test_requests_whose_contexts_begin_alike_share_those_blocks_and_decode_as_alone(attn, storage):
    """SHARING's requests through a pool that holds two at a time (blocks of 4 positions): those that join
    once another with the same beginning has written it take its blocks (engine.stats' shared_tokens), and
    every request's greedy tokens are still its prompt's alone through a cache of the same storage, with
    shared keys, and with windows of 5 (int4: 64 positions and no window, as above), whose first blocks go
    back before a later request joins, so that it shares none."""
    for layout, knobs in list(LAYOUTS.items())[:2 if storage is Int4Groups4 else 3]:
        model = tiny_model(attn, n_layer=2, block_size=64, **knobs)
        length = 64 if storage is Int4Groups4 else None
        engine = Engine(model, model.kv_cache_bytes(2, 32, torch.float32, storage), storage, torch.float32,
                        block_size=4, chunk=16)
        got = engine.generate(SHARING, NEW)
        assert got == [alone(model, prompt, NEW, storage, length) for prompt in SHARING], layout
        assert (engine.stats["shared_tokens"] > 0) == (layout != "window"), layout
        assert engine.cache.held_bytes() == 0, layout
        assert not engine.cache.prefixes and not engine.cache.holders, layout


def test_a_shared_block_is_held_until_the_last_sequence_holding_it_lets_it_go():
    """publish makes a sequence's whole blocks findable by their tokens and all before them; attach gives a
    new sequence the longest run its tokens begin with, short of their last; released, a shared block stays
    with the sequences still holding it, and goes back to the pool with the last."""
    model = tiny_model("mha", n_layer=2, block_size=64)
    cache = PagedKVCache(model, 10**6, torch.float32, block_size=4)
    tokens, other = prompts([10])[0], [9, 9, 9, 9, 4, 4, 4, 4, 1, 2]
    with torch.no_grad():
        for seq, context in (("a", tokens), ("z", other)):
            assert cache.attach(seq, context) == 0 and cache.grow(seq, 10)  # nothing of it published yet
            cache.select([seq])
            model(torch.tensor([context]), cache=cache)
            cache.publish(seq, context)  # 10 positions: blocks 0 and 1 whole, block 2 not
    assert cache.attach("b", tokens + [5]) == 8 and cache.attach("c", tokens[:5]) == 4
    assert cache.attach("d", tokens[:4]) == 0 and cache.attach("e", [tokens[0] + 1] + tokens[1:]) == 0
    assert cache.attach("x", tokens[:4] + other[4:]) == 4  # z's second block, after other tokens: not it
    cache.release("z")
    for owner in cache.sources:
        assert cache.tables["b"][owner] == cache.tables["a"][owner][:2]
        assert cache.tables["c"][owner] == cache.tables["a"][owner][:1]
    held = cache.held_bytes()
    assert held == 3 * len(cache.sources) * cache.block_bytes  # a's three blocks a layer, shared
    cache.release("a")
    assert cache.held_bytes() == 2 * len(cache.sources) * cache.block_bytes
    assert cache.attach("f", tokens) == 8  # still found: b holds them
    for seq in "bcfx":
        cache.release(seq)
    assert cache.held_bytes() == 0 and len(cache.free) == cache.n_blocks
    assert not cache.prefixes and not cache.prefix_of and not cache.holders


def test_the_pool_holds_a_sequences_blocks_and_a_window_gives_back_what_falls_out_of_it():
    """A layer that sees every position holds all of a sequence's blocks; a layer whose window is 5 holds at
    most the blocks of its last 5 positions and the one being filled; the cache's held_bytes counts the
    blocks held, a block being 4 positions of one layer's entries (fp32); all go back when it ends."""
    model = tiny_model("lrkv", n_layer=2, block_size=64, window=5, window_pattern="SL")
    cache = PagedKVCache(model, 10**6, torch.float32, block_size=4)
    per_layer = kv_cache_elements_per_token(model) // 2 * 4  # fp32 bytes a position in one layer
    assert cache.block_bytes == 4 * per_layer and cache.n_blocks == 10**6 // cache.block_bytes
    with torch.no_grad():
        for n, token in enumerate(prompts([30])[0]):
            assert cache.grow("a", 1)
            cache.select(["a"])
            model(torch.tensor([[token]]), cache=cache)
            windowed, full = ([b for b in cache.tables["a"][layer] if b is not None] for layer in (0, 1))
            assert len(full) == n // 4 + 1 and len(windowed) <= -(-5 // 4) + 1, n
            assert cache.held_bytes() == (len(full) + len(windowed)) * cache.block_bytes
    cache.release("a")
    assert cache.held_bytes() == 0 and len(cache.free) == cache.n_blocks


def test_bad_input_is_one_line():
    model = tiny_model("mha", n_layer=2, block_size=64)
    engine = Engine(model, 10**5, dtype=torch.float32, block_size=4)
    for prompts_, new, said in (([[1, 2], []], 4, "prompt 1 is empty"),
                                ([[1] * 65], 4, "prompt 0 has 65 tokens, longer than the context"),
                                ([[1] * 60], 5, "prompt 0 of 60 tokens and max_new_tokens=5 pass the"),
                                ([[1]], 0, "max_new_tokens=0: must be a positive integer")):
        with pytest.raises(ValueError, match=said) as error:
            engine.generate(prompts_, new)
        assert "\n" not in str(error.value)
    two_blocks = 4 * kv_cache_elements_per_token(model) * 4  # fp32
    small = Engine(model, two_blocks, dtype=torch.float32, block_size=4)
    with pytest.raises(ValueError, match="holds 2 blocks, fewer than the 4 that prompt 0 of 5 tokens"):
        small.generate([[1] * 5], 3)
    with pytest.raises(ValueError, match="holds no block of 4 positions"):
        Engine(model, 100, dtype=torch.float32, block_size=4)


def test_every_argument_is_checked_before_any_work_in_one_line():
    """The constructor's and generate's arguments, each refused in one ValueError line before a forward:
    an empty list of prompts, max_new_tokens of another length, a budget, block size or chunk below 1,
    token ids outside the vocabulary or not integers, a temperature below 0, top_k below 1."""
    model = tiny_model("mha", n_layer=2, block_size=64)
    for knobs, said in ((dict(kv_budget_bytes=-1), "kv_budget_bytes=-1: must be a positive integer"),
                        (dict(kv_budget_bytes=0), "kv_budget_bytes=0: must be a positive"),
                        (dict(chunk=0), "chunk=0: must be a positive integer"),
                        (dict(chunk=2.5), "chunk=2.5: must be a positive integer"),
                        (dict(block_size=0), "block_size=0: must be a positive integer"),
                        (dict(storage="int8"), "storage='int8': must be a cache class"),
                        (dict(dtype=torch.int8), "dtype=torch.int8: must be a floating torch.dtype")):
        with pytest.raises(ValueError, match=said) as error:
            Engine(model, **{"kv_budget_bytes": 10**5, **knobs})
        assert "\n" not in str(error.value)
    engine = Engine(model, 10**5, dtype=torch.float32, block_size=4)
    engine.forward = None  # a forward would fail with a TypeError: every refusal below comes before one
    V = TINY.vocab_size
    for args, knobs, said in ((([], 4), {}, "prompts=\\[\\]: must be a non-empty list"),
                              ((torch.zeros(20, 30, dtype=torch.long), 4), {},
                               "prompts of type Tensor: must be a non-empty list"),
                              (([[1], [2], [3]], [4, 4]), {}, "2 max_new_tokens for 3 prompts"),
                              (([[1], [2]], [4, -1]), {}, "max_new_tokens=-1: must be a positive integer"),
                              (([[1, V]], 4), {}, f"prompt 0 holds a token id outside the vocabulary, "
                                                  f"0..{V - 1}"),
                              (([[1], [-1]], 4), {}, "prompt 1 holds a token id outside the vocabulary"),
                              (([[1.5]], 4), {}, "prompt 0: must be a list of integer token ids"),
                              ((["hello"], 4), {}, "prompt 0: must be a list of integer token ids"),
                              (([[1]], 4), dict(temperature=-1), "temperature=-1: must be a number of"),
                              (([[1]], 4), dict(top_k=0), "top_k=0: must be a positive integer"),
                              (([[1]], 4), dict(vocab_size=V + 1), f"vocab_size={V + 1}: more than the")):
        with pytest.raises(ValueError, match=said) as error:
            engine.generate(*args, **knobs)
        assert "\n" not in str(error.value)
    assert engine.stats == {} and len(engine.cache.free) == engine.cache.n_blocks


@pytest.mark.parametrize("attn", ["lrkv", "mla"])
def test_a_call_that_raises_leaves_the_engine_as_it_was(attn):
    """A call that fails midway (here its third forward raises, as an interrupt or a fault would) gives back
    every block its requests held, so that the next call decodes the tokens a new engine does."""
    model = tiny_model(attn, n_layer=2, block_size=64)
    engine, fresh = (Engine(model, 10**6, Int4KVCache, torch.float32, block_size=4, chunk=16) for _ in "ab")
    forward, calls = engine.forward, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a fault in the third forward")
        return forward(*args, **kwargs)

    engine.forward = failing
    with pytest.raises(RuntimeError, match="a fault in the third forward"):
        engine.generate(prompts([20, 3, 9], seed=1), 4)
    assert engine.cache.held_bytes() == 0 and len(engine.cache.free) == engine.cache.n_blocks
    assert engine.generate(prompts([3, 20]), 3) == fresh.generate(prompts([3, 20]), 3)
