"""Five attention variants of the kind a reader adds, defined only for the tests (tests/test_variant.py
registers them under --attn names and puts their steps, conversions and head maps in the tables): each
written as a variant of one's own would be, in a file that imports only torch and model.py, so that
export_hf.py carries it into an exported folder as it is."""

from dataclasses import replace

import torch
import torch.nn as nn

from model import GroupedQueryAttention, LowRankKVAttention, apply_rope, norm, rms


class InterleavedGroupedQueryAttention(GroupedQueryAttention):
    """G = config.n_kv_head key/value heads, query head h reading head h mod G, so that neighbouring
    query heads read different keys. GQA's projections, checks and cache (2 G d_h per token); only
    which query head reads which key/value head differs."""

    def keys_values(self, x, rope):
        return self.tiled(*super().keys_values(x, rope))

    def tiled(self, k, v):
        # SDPA's enable_gqa groups heads contiguously: tile the G heads H/G times instead, so that
        # head h meets head h mod G
        tiles = self.n_head // self.n_kv_head
        return k.repeat(1, 1, tiles, 1), v.repeat(1, 1, tiles, 1)

    def cache_entries(self, x, rope):
        k, v = super().keys_values(x, rope)  # the G heads, not tiled
        return {"k": k, "v": v}

    def cached_keys_values(self, rope, k, v):
        return self.tiled(k, v)


class LowRankKeyAttention(LowRankKVAttention):
    """LRK: LRKV's keys, K_h = X W_shared^K + (X U_h^K)(B_h^K)^T, and one value V = X W_shared^V that
    every head shares, as MQA's. Cache per token 2 d_h + H r + H."""

    def __init__(self, config, layer):
        super().__init__(config, layer)
        del self.U_v, self.B_v  # LRKV's value residual, which LRK does without

    def key_parts(self, x):
        """K_shared = X W_shared, R^K = X U_h and every head's K_h = K_shared + R_h^K (B_h^K)^T."""
        k_shared, r_k = self.W_shared_k(x), self.residual_coords(self.U_k, x)
        return k_shared, r_k, k_shared.unsqueeze(2) + self.residual(r_k, self.B_k)

    def keys_values(self, x, rope):
        k = self.key_parts(x)[2]  # (B, T, H, d_h): K_h
        return apply_rope(norm(k), rope), self.values(self.W_shared_v(x))

    def values(self, v_shared):
        return v_shared.unsqueeze(2).expand(-1, -1, self.n_head, -1)  # (B, S, H, d_h)

    def cache_shapes(self):
        return {"k_shared": (self.head_dim,), "r_k": (self.n_head, self.lrkv_rank), "rho": (self.n_head,),
                "v_shared": (self.head_dim,)}

    def cache_entries(self, x, rope):
        k_shared, r_k, k = self.key_parts(x)
        return {"k_shared": apply_rope(k_shared.unsqueeze(2), rope).squeeze(2), "r_k": r_k, "rho": rms(k),
                "v_shared": self.W_shared_v(x)}

    def cached_keys_values(self, rope, k_shared, r_k, rho, v_shared):
        return self.keys(k_shared, r_k, rho, rope), self.values(v_shared)


class PerLayerRankAttention(LowRankKVAttention):
    """LRKV whose rank grows with depth: lrkv_rank in layer 0, twice it in layer 1, and so on up to
    head_dim. Nothing else changes: every count (parameters, cache) follows the layer's rank, and
    LRKV's single-token step and conversion read the layer's rank."""

    def __init__(self, config, layer):
        super().__init__(replace(config, lrkv_rank=layer_rank(config, layer)), layer)


def layer_rank(config, layer):
    return min(config.head_dim, config.lrkv_rank * (layer + 1))


class GroupedLowRankKVAttention(LowRankKVAttention):
    """Grouped LRKV: G = n_kv_head residuals per token, R_g = X U_g, each read by H/G consecutive
    heads, every head its own B_h: K_h = K_shared + R_g B_h^T for g = h G // H, V_h likewise. Cache
    per token 2 d_h + 2 G r + H. LRKV with G-wide U and cache, each residual read per head."""

    def __init__(self, config, layer):
        super().__init__(config, layer)
        self.n_groups = config.n_kv_head
        self.U_k = nn.Linear(config.n_embd, self.n_groups * config.lrkv_rank, bias=False)
        self.U_v = nn.Linear(config.n_embd, self.n_groups * config.lrkv_rank, bias=False)

    @classmethod
    def check(cls, config):
        if config.n_head % config.n_kv_head:
            config.reject("n_kv_head", f"a divisor of n_head = {config.n_head}")

    def per_head(self, R):
        """The residual each head reads, (B, S, G, r) -> (B, S, H, r): residual g read by heads g H / G
        on; R itself where it is already per head."""
        return R.repeat_interleave(self.n_head // R.size(2), dim=2)

    def residual(self, R, factor):
        return super().residual(self.per_head(R), factor)

    def cache_shapes(self):
        residuals = (self.n_groups, self.lrkv_rank)
        return {**super().cache_shapes(), "r_k": residuals, "r_v": residuals}


class ScaledSoftmaxAttention(LowRankKVAttention):
    """LRKV whose heads each have a learned temperature tau_h, times 1 + layer / 4, in their softmax:

        softmax(tau_h (1 + layer / 4) q_h k_h^T / sqrt(d_h))

    an attend of its own, whose parameter tau (one number a head, no matrix: AdamW's, not Muon's) a
    layer that reads another's keys (--cla, --yoco) keeps as its own (attend_weights), and the factor
    1 + layer / 4 makes a reader's softmax differ from its owner's. LRKV's single-token step, which a
    subclass would inherit, knows nothing of tau: test_variant.py registers scaled_softmax_step."""

    attend_weights = ("tau",)

    def __init__(self, config, layer):
        super().__init__(config, layer)
        self.tau = nn.Parameter(torch.ones(config.n_head))

    def reset_parameters(self):
        super().reset_parameters()
        nn.init.uniform_(self.tau, 0.5, 2.0)

    def attend(self, q, k, v, mask=None):
        scale = self.tau * (1 + self.layer / 4)  # (H,)
        return super().attend(q * scale.view(-1, 1).to(q.dtype), k, v, mask)
