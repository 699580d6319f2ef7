"""docs/decoding.md's roofline measurements: at batch B and context S, on bench.py's cpu preset (one
128M layer), fp32, interleaved in rounds, CPU-time medians (one thread: a core that other jobs share
costs wall time, not CPU time):
- every variant's whole single-token step, its caches filled with random entries (no prefill:
  a step's cost does not depend on the values, and a 16 x 8,192 prefill takes minutes here);
- LRKV's key_scores alone, and its rotated-residual GEMM alone (the products of
  _residual_key_scores, without the dot product with r_k);
- the machine's ceilings in the same rounds: a 4096^3 matmul, and summing 1 GiB of fp32 (one add
  per 4 bytes read: bound by reading memory, as reading a cache is).

    OMP_NUM_THREADS=1 PYTHONPATH=. python docs/bench/decode_floor.py 16 8192 5
"""

import statistics
import sys
import time

import torch

from bench import PRESETS, inference_model
from model import ATTENTION, GPTConfig


def filled(attn, B, S):
    """The model, its caches full but for the last position, and a token to feed."""
    config = GPTConfig(attn=attn, **{**PRESETS["cpu"]["model"], "block_size": S})
    model = inference_model(config, torch.device("cpu"), torch.float32)
    caches = model.new_caches(B, S)
    for cache in caches:
        for name, buf in cache.named_buffers():
            buf.uniform_(0.5, 1.5) if name == "rho" else buf.uniform_(-0.5, 0.5)  # RMSs stay positive
    return model, caches, torch.randint(config.vocab_size, (B, 1))


def step(model, caches, token):
    for cache in caches:
        cache.pos = cache.max_len - 1
    return model(token, caches=caches)


@torch.inference_mode()
def main(B, S, rounds):
    setups = {attn: filled(attn, B, S) for attn in ATTENTION}
    model, caches, _ = setups["lrkv"]
    lrkv, cache = model.blocks[0].attn, caches[0]
    H, d_h, r = lrkv.n_head, lrkv.head_dim, lrkv.lrkv_rank
    q = lrkv.queries(torch.randn(B, 1, H * d_h), cache.rope[-1:])
    cached = (cache.k_shared, cache.r_k, cache.rho, cache.rope)
    M = torch.randn(B, d_h, H * r)  # the GEMM's cost does not depend on the matrix key_scores builds
    chunk = max(1, 2**22 // (B * H * r * 4))  # _residual_key_scores' chunks on a CPU, fp32
    a, b = torch.randn(2, 4096, 4096)
    x = torch.ones(2**28)  # 1 GiB

    def gemm():
        for s in range(0, S, chunk):
            cache.rope[s:s + chunk] @ M

    work = {attn: (lambda attn=attn: step(*setups[attn])) for attn in ATTENTION}
    work.update(key_scores=lambda: lrkv.key_scores(q, *cached), residual_gemm=gemm, matmul_4096=lambda: a @ b,
                read_1gib=x.sum)
    seconds = {name: [] for name in work}
    for _ in range(rounds):
        for name, f in work.items():
            t0 = time.process_time()
            f()
            seconds[name].append(time.process_time() - t0)
    median = {name: statistics.median(t) for name, t in seconds.items()}
    for name, t in median.items():
        ratio = f", x mha {t / median['mha']:.2f}" if name in ATTENTION else ""
        print(f"{name}: {1000 * t:.1f} ms{ratio}")
    flops = 2 * S * d_h * B * H * r
    print(f"residual GEMM: {flops / 1e9:.2f} GFLOP at {flops / median['residual_gemm'] / 1e9:.1f} GFLOP/s; "
          f"4096^3 matmul {2 * 4096**3 / median['matmul_4096'] / 1e9:.1f} GFLOP/s; "
          f"reading memory {x.nbytes / median['read_1gib'] / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
