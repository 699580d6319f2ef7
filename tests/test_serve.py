"""Many sequences at once: rows at different positions through model.py's forward (ring.py's left-padded
rows) against each row alone; lib/attention/paged.py's paged cache and lib/attention/engine.py's continuous
batching against each prompt decoded alone with the plain cache, for every variant, layout and storage,
preempted too; bad input in one line."""

import pytest
import torch

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
