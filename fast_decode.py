"""
Decoding speed: the single-token step on fixed shapes, which torch.compile captures once (as one
CUDA graph on a GPU). sample.py --compile and bench.py's compiled decode column run it.

model.py decodes exactly, on caches that grow by a position a step (KVCache): every step has new
shapes, which torch.compile would recompile for, and on a GPU each step pays its kernel launches
one by one. Here filled caches turn fixed (fix): one position tensor shared by every layer, each
new token written in place at it, and attention over all max_len positions with those past it
masked (the variants apply a cache's mask() wherever it is not None). The math is the eager
step's, over max_len positions instead of pos + 1: the cost of a step no longer depends on its
position.

It is a module of its own because it changes how fast a step runs, never what it computes:
model.py holds the variants and what makes them decode exactly, and reads as their math; the
tensor positions, static buffer addresses and the compiled function are for whoever times
decoding, and GPT.stream reaches them only through its step argument (compiled_decode).
"""

import functools

import torch
import torch.nn as nn


class FixedKVCache(nn.Module):
    """A filled KVCache's buffers, the same tensors, behind shapes that no longer change: pos is a
    (1,) tensor that every layer's cache shares, update writes the one new token there and returns
    the whole buffers, and mask() is the positions of them that the token may see."""

    def __init__(self, cache, pos):
        super().__init__()
        self.pos, self.max_len, self.rope = pos, cache.max_len, cache.rope
        for name, buf in cache.named_buffers():
            torch._dynamo.mark_static_address(buf)  # a CUDA graph may keep its address
            self.register_buffer(name, buf, persistent=False)

    def next_rope(self, T):
        if T != 1:
            raise ValueError(f"a fixed-shape cache takes one token a step, not {T}")
        return self.rope[self.pos]  # (1, rope_dim)

    def mask(self):
        return (torch.arange(self.max_len, device=self.pos.device) <= self.pos)[None]  # (1, max_len)

    def update(self, **new):
        for name, x in new.items():
            getattr(self, name).index_copy_(1, self.pos, x.to(getattr(self, name).dtype))
        return {name: getattr(self, name).to(x.dtype) for name, x in new.items()}


def fix(caches):
    """Fixed-shape caches over the buffers of caches that a prefill has filled, from their position
    on."""
    pos = torch.tensor([caches[0].pos], device=caches[0].rope.device)
    return [FixedKVCache(cache, pos) for cache in caches]


def fixed_step(model, token, caches):
    """The last logits (B, vocab) of one token (B, 1) through fixed caches: the step
    compiled_step compiles, with the same shapes at every position."""
    return model(token, caches=caches)[0][:, -1]


@functools.cache
def compiled_fixed_step():
    """One compiled step for every model and cache of the same shapes: torch.compile lifts modules'
    weights and buffers into graph inputs, so new caches reuse the graph. On a GPU,
    "reduce-overhead" replays it as a CUDA graph, one launch for the whole step. Made on first use:
    importing torch.compile's machinery costs a process about 2 s on a CPU, which sample.py
    without --compile need not pay."""
    return torch.compile(fixed_step, mode="reduce-overhead" if torch.cuda.is_available() else None)


def compiled_step(model, token, caches):
    return compiled_fixed_step()(model, token, caches)


def compiled_decode(model, token, caches):
    """GPT.stream's step, compiled: caches that a prefill has just filled are fixed on their first
    step, in place in the list that stream passes every step, then the compiled step runs and the
    shared position moves on."""
    if not isinstance(caches[0], FixedKVCache):
        caches[:] = fix(caches)
    # contiguous: a column of stream's growing idx has a new stride at every step, which recompiles
    logits = compiled_step(model, token.contiguous(), caches)
    caches[0].pos += 1
    return logits
