"""Sliding windows and shared keys (--window with --window_pattern, --cla, --yoco) with every variant:
the full forward against the float64 reference that masks by hand (references.naive_forward), and
every decoding path against the full forward, for text longer than the window and than the context;
a local layer's ring of W positions, and kv_cache_bytes by its formula."""

import math

import pytest
import torch

from lib.attention.decode import ExactKVCache, FixedKVCache, exact_step, generate
from lib.attention.paged import paged_cache_class
from lib.attention.quant import CACHES, Int4KVCache
from lib.attention.ring import RingKVCache, gather
from model import VARIANTS, GPTConfig
from references import TINY, cropped_greedy, naive_forward, tiny_model, token_by_token

W = 5  # the tests' window: TINY's block_size is 32
# Each layout, with the layers it makes (n_layer = 4): who owns keys, who reads whose, who is local
LAYOUTS = {
    "window": dict(window=W, window_pattern="SL"),  # S L S L: two rings, two full buffers
    "window+cla2": dict(window=W, window_pattern="S", cla=2),  # S reads S's ring; L reads S: full
    "yoco": dict(yoco=True),  # layers 2 and 3 read layer 2's
    "all": dict(window=W, window_pattern="SSL", cla=2, yoco=True),  # 0 S owns a ring, 1 S reads it
}


def model_of(attn, layout, seed=0):
    return tiny_model(attn, seed, n_layer=4, **LAYOUTS[layout]).double()


@pytest.mark.parametrize("attn", VARIANTS)
def test_the_full_forward_is_the_reference_that_masks_by_hand(attn):
    idx = torch.randint(0, TINY.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    for layout in LAYOUTS:
        model = model_of(attn, layout)
        with torch.no_grad():
            ours = model(idx[None])[0][0]
        torch.testing.assert_close(ours.double(), naive_forward(model, idx), rtol=1e-6, atol=1e-6, msg=layout)


def fixed_steps(model, idx, prefix):
    """token_by_token through a FixedKVCache, whose position moves outside the step (as compiled_decode
    moves it)."""
    cache = model.new_cache(idx.size(0), idx.size(1), cache_class=RingKVCache)
    model(idx[:, :prefix], cache=cache)
    cache, logits = FixedKVCache(cache), []
    for t in range(prefix, idx.size(1)):
        logits.append(model(idx[:, t:t + 1], cache=cache)[0])
        cache.pos += 1
    return torch.cat(logits, dim=1)


def in_chunks(model, idx, sizes):
    cache = model.new_cache(idx.size(0), idx.size(1))
    chunks, start = [], 0
    for size in sizes:
        chunks.append(model(idx[:, start:start + size], cache=cache)[0])
        start += size
    return torch.cat(chunks, dim=1)


@pytest.mark.parametrize("attn", VARIANTS)
def test_every_decoding_path_is_the_full_forward(attn):
    """In float64, to the fp32 logits' rounding: a prompt of 12 tokens (more than W) in one chunk,
    then token by token through the plain cached path, the exact steps and the fixed-shape step; and
    the prefill in chunks of 7, 1 and 12."""
    idx = torch.randint(0, TINY.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    for layout in LAYOUTS:
        model = model_of(attn, layout)
        with torch.no_grad():
            full = model(idx)[0]
            paths = {"plain": token_by_token(model, idx, 12, torch.float64),
                     "exact": token_by_token(model, idx, 12, torch.float64, ExactKVCache),
                     "fixed": fixed_steps(model, idx, 12)}
            for name, logits in paths.items():
                torch.testing.assert_close(logits, full[:, 12:], rtol=1e-6, atol=1e-6, msg=f"{layout} {name}")
            chunked = in_chunks(model, idx, (7, 1, 12))
            torch.testing.assert_close(chunked, full, rtol=1e-6, atol=1e-6, msg=layout)


@pytest.mark.parametrize("attn", VARIANTS)
def test_text_that_outgrows_the_context_decodes_as_the_full_forward(attn):
    prompt = torch.randint(0, TINY.vocab_size, (1, 6), generator=torch.Generator().manual_seed(3))
    n = TINY.block_size + 10  # the text outgrows the context: the model starts again from its last half
    for layout in ("all",):  # windows, CLA and YOCO together
        model = model_of(attn, layout)
        expected = cropped_greedy(model, prompt, n)
        assert torch.equal(generate(model, prompt, n, temperature=0, step=exact_step), expected), layout
        assert torch.equal(generate(model, prompt, n, temperature=0), expected), layout


def test_a_token_more_than_w_positions_back_does_not_reach_a_local_layer():
    model = model_of("lrkv", "window")
    assert model.layout.windows[:2] == [W, None]
    outputs = []
    hooks = [model.blocks[layer].attn.register_forward_hook(lambda m, args, out: outputs.append(out))
             for layer in (0, 1)]
    idx = torch.randint(1, TINY.vocab_size, (1, 16), generator=torch.Generator().manual_seed(4))
    changed = idx.clone()
    changed[0, 0] = 0
    with torch.no_grad():
        model(idx), model(changed)
    for hook in hooks:
        hook.remove()
    local, full, local_changed, full_changed = outputs
    assert torch.equal(local[:, W:], local_changed[:, W:])  # position W and later: token 0 is out of sight
    assert not torch.equal(local[:, W - 1], local_changed[:, W - 1])  # position W - 1 still sees it
    assert not torch.equal(full[:, -1], full_changed[:, -1])  # an L layer sees it everywhere


def elements(model, layer):
    return sum(math.prod(shape) for shape in model.blocks[layer].attn.cache_shapes().values())


@pytest.mark.parametrize("attn", VARIANTS)
def test_a_local_layer_keeps_a_ring_of_w_positions_and_the_bytes_follow_the_formula(attn):
    """kv_cache_bytes(B, S) = B * bytes * sum over the owners of elements * min(S, span), the span
    max_len where a layer reading the owner sees all positions, else the widest window among them."""
    for layout, spans in (("window", {0: W, 1: None, 2: W, 3: None}), ("window+cla2", {0: W, 2: None}),
                          ("yoco", {0: None, 1: None, 2: None}), ("all", {0: W, 2: None})):
        model = model_of(attn, layout).float()
        cache = model.new_cache(2, 30, device="meta")
        assert [layer for layer in range(4) if cache.length(layer)] == list(spans)
        for layer, span in spans.items():
            assert {buf.size(1) for buf in cache.layers[layer].values()} == {span or 30}
        for S in (3, W, 17, 32):
            per_position = {layer: 2 * 4 * elements(model, layer) for layer in spans}  # B = 2, fp32
            expected = sum(per_position[layer] * min(S, span or S) for layer, span in spans.items())
            assert model.kv_cache_bytes(2, S) == expected, (layout, S)


@pytest.mark.parametrize("overrides, message", [
    (dict(window=0), "--window=0: must be from 1 to block_size = 2048"),
    (dict(window=4096), "--window=4096: must be from 1 to block_size = 2048"),
    (dict(window=64, window_pattern="SSXL"), "--window_pattern='SSXL': must be letters S"),
    (dict(window=64, window_pattern=""), "--window_pattern='': must be letters S"),
    (dict(yoco=True, n_layer=3), "--n_layer=3: must be even with --yoco"),
])
def test_bad_windows_and_sharing_are_one_line(overrides, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace("[", r"\[")) as error:
        GPTConfig(**overrides)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("batch", [1, 3])
def test_gather_reads_the_slots_that_indexing_reads(batch):
    """ring.gather, every storage's read of slots: a slice or an index (S,), repeated and out of order, over
    a buffer as it lies and over a permuted view (quant.py's layouts), is buffer[:, slots]."""
    buffer = torch.randn(batch, 10, 2, 3)
    permuted = buffer.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # the same values, position last
    for slots in (slice(2, 7), slice(None), torch.tensor([4, 0, 9, 4]), torch.arange(10)):
        for b in (buffer, permuted):
            assert torch.equal(gather(b, slots), buffer[:, slots])


class Int4Groups4(Int4KVCache):
    group = 4  # key groups that a window of 8 holds whole


# (storage, window): every storage of quant.CACHES with a window shorter than the prompt; int4's own
# groups of 64 with a window of 64 (a narrower ring's groups are its W slots, the paged cache's blocks 64
# positions: not one storage), and in groups of 4 with a window of 8
ONE_MEANING = [("none", 8), ("int8", 8), ("int4", 64), ("int4 in groups of 4", 8)]


@pytest.mark.parametrize("storage, window", ONE_MEANING, ids=[s for s, _ in ONE_MEANING])
def test_a_storage_means_one_thing_to_the_ring_and_the_paged_cache(storage, window):
    """A prompt longer than the window, prefilled at once, then tokens one at a time: the logits of
    sample.py --prompt's path (the ring cache, its exact steps) and of the engine's (the paged cache) are
    the same to round-off for every variant, the prefill's included: the ring's chunk, which waits beside
    the ring, reads as the storage gives it back, and the ring takes a chunk's positions in order."""
    cache_class = Int4Groups4 if storage == "int4 in groups of 4" else CACHES[storage]
    P, N = window + 16, 3
    g = torch.Generator().manual_seed(0)
    prompt, more = (torch.randint(0, TINY.vocab_size, (1, n), generator=g) for n in (P, N))
    for attn in VARIANTS:
        model = tiny_model(attn, n_layer=2, block_size=P + N + 1, window=window, window_pattern="SL")
        with torch.no_grad():
            ring = model.new_cache(1, P + N + 1, torch.float32, cache_class=cache_class)
            ours = [model(prompt, cache=ring)[0][0, -1]]
            for t in range(N):
                logits, ring = exact_step(model, more[:, t:t + 1], ring)
                ours.append(logits[0])
            paged = paged_cache_class(cache_class)(model, 10**7, torch.float32, block_size=4)
            theirs = []
            for tokens in (prompt, *more.split(1, dim=1)):
                paged.grow(0, tokens.size(1))
                paged.select([0])
                theirs.append(model(tokens, cache=paged)[0][0, -1])
        torch.testing.assert_close(torch.stack(ours), torch.stack(theirs), atol=1e-5, rtol=1e-5, msg=attn)
