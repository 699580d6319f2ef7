"""
Continuous batching (Orca, Yu et al. 2022; vLLM's scheduler, Kwon et al. 2023): many requests decoded
at once through one paged cache (paged.py) of a byte budget, each sequence at its own position.

    Engine(model, kv_budget_bytes).generate(prompts, max_new_tokens, temperature=0)

takes prompts of different lengths (lists of token ids) and gives back each one's new tokens, a list
of token lists in the prompts' order. A request waits, then runs, then leaves. All of them are there from
the start, so the line is ordered by the tokens each will decode, the most first (longest processing time
first, the classic rule for finishing a set of jobs early): first come first, the run would end with the
longest request admitted last decoding alone, one row a forward (the bench's cpu workload of 32 requests,
first come first: its last request, 96 new tokens, decoded 57 of them alone). Each step:

  1. admit: waiting requests join, in line, while the pool has the blocks of their whole context
     free, beside those that joined requests' prefills still need and one for each running request,
     which its next tokens will soon need;
  2. prefill: joined requests' contexts go into the cache, at most `chunk` tokens a step in all, so
     that a long prompt takes several steps (its chunks) and running requests keep decoding between
     them; a context's last chunk gives its first new token. A context that begins as one already in
     the cache did takes those blocks instead of its first chunks, shared (paged.py's attach), where
     their writer has published them (after each forward);
  3. decode: every request whose context is in takes one more token, all of them in one forward.

Where the pool lacks a block for a request's next tokens, the newest running request is preempted:
its blocks go back, and it waits again first in line, to be recomputed (its prompt and the tokens it
has so far prefilled again) when it fits. A request leaves when it has its max_new_tokens, its blocks
back to the pool. Every forward is model.py's over the paged cache (the plain cached path, or for one
token a row LRKV's and MLA's exact steps), which every variant and layout decodes exactly.
"""

import math
import operator
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from lib.attention.paged import blocks_for, paged_cache_class
from lib.attention.ring import RingKVCache
from model import sample


def positive(name, value):
    """value, where it is a positive integer; else a ValueError of one line."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive integer")
    return value


@dataclass
class Request:
    id: int
    prompt: list
    max_new_tokens: int
    out: list = field(default_factory=list)  # its new tokens so far
    cached: int = 0  # the tokens of its context in the cache
    first: float = 0.0  # when it drew its first new token (Engine.clock)

    def context(self):  # what a prefill puts in the cache: the prompt and the tokens drawn so far
        return self.prompt + self.out

    def to_prefill(self):
        """The context's tokens a prefill has still to put in the cache: none once it decodes (all in but the
        token it drew last, which the next decode step feeds)."""
        left = len(self.context()) - self.cached
        return 0 if self.out and left == 1 else left


class Engine:
    """Continuous batching over a paged cache of kv_budget_bytes (the module's docstring). storage: a
    cache class of quant.CACHES (plain, int8, int4), paged; dtype: the cache's (the weights' by default);
    chunk: the prefill tokens a step; clock: seconds (tools/bench.py's: CPU time at one thread);
    share_prefixes: a context's beginning shared where another's was the same. stats, after generate:
    peak_in_flight, preemptions, forwards, shared_tokens (context tokens not computed again), seconds,
    new_tokens, mean_s_per_token; and of the decode forwards (one token a row): decode_forwards, their
    decode_rows, decode_positions (each row's context, the new token's included) and decode_seconds, summed
    (tools/serve.py's roofline of a mean step)."""

    def __init__(self, model, kv_budget_bytes, storage=RingKVCache, dtype=None, block_size=16, chunk=256,
                 clock=time.perf_counter, share_prefixes=True):
        for name, value in dict(kv_budget_bytes=kv_budget_bytes, block_size=block_size, chunk=chunk).items():
            positive(name, value)
        if not (isinstance(storage, type) and issubclass(storage, RingKVCache)):
            raise ValueError(f"storage={storage!r}: must be a cache class of quant.CACHES (a RingKVCache's)")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype={dtype!r}: must be a floating torch.dtype, or None (the weights')")
        if not callable(clock) or not isinstance(share_prefixes, bool):
            raise ValueError(f"clock={clock!r}, share_prefixes={share_prefixes!r}: must be a function "
                             f"and a bool")
        self.model, self.chunk, self.clock, self.share_prefixes = model, chunk, clock, share_prefixes
        self.cache = paged_cache_class(storage)(model, kv_budget_bytes, dtype, block_size=block_size)
        self.stats = {}

    def check(self, prompts, max_new_tokens, temperature=0, top_k=None, vocab_size=None):
        """generate's arguments, prompts as lists of ids and max_new_tokens one a prompt; a ValueError of one
        line for the first argument or request that cannot be served."""
        L, V = self.model.config.block_size, self.model.config.vocab_size
        if not isinstance(prompts, (list, tuple)) or not prompts:
            what = (f"={prompts!r}" if isinstance(prompts, (list, tuple))
                    else f" of type {type(prompts).__name__}")  # a tensor's repr runs over lines
            raise ValueError(f"prompts{what}: must be a non-empty list of prompts (lists of token ids)")
        if not isinstance(max_new_tokens, (list, tuple)):
            max_new_tokens = [max_new_tokens] * len(prompts)
        if len(max_new_tokens) != len(prompts):
            raise ValueError(f"{len(max_new_tokens)} max_new_tokens for {len(prompts)} prompts: give one "
                             f"number for all, or one a prompt")
        if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                or not 0 <= temperature < math.inf):
            raise ValueError(f"temperature={temperature!r}: must be a number of at least 0")
        for name, value in dict(top_k=top_k, vocab_size=vocab_size).items():
            if value is not None and positive(name, value) > V:
                raise ValueError(f"{name}={value}: more than the model's vocab_size = {V}")
        ids = []
        for i, prompt in enumerate(prompts):
            try:
                ids.append([operator.index(token) for token in prompt])
            except TypeError:
                raise ValueError(f"prompt {i}: must be a list of integer token ids") from None
            if any(not 0 <= token < V for token in ids[-1]):
                raise ValueError(f"prompt {i} holds a token id outside the vocabulary, 0..{V - 1}")
        counts = list(max_new_tokens)
        for i, (prompt, max_new_tokens) in enumerate(zip(ids, counts)):
            positive("max_new_tokens", max_new_tokens)
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty: a request needs at least one token")
            if len(prompt) > L:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens, longer than the context, "
                                 f"block_size = {L}")
            if len(prompt) + max_new_tokens > L:
                raise ValueError(f"prompt {i} of {len(prompt)} tokens and max_new_tokens={max_new_tokens} "
                                 f"pass the context, block_size = {L}")
            need = blocks_for(self.cache, len(prompt) + max_new_tokens, self.chunk)
            if need > self.cache.n_blocks:
                raise ValueError(f"a KV budget of {self.cache.n_blocks * self.cache.block_bytes} bytes holds "
                                 f"{self.cache.n_blocks} blocks, fewer than the {need} that prompt {i} of "
                                 f"{len(prompt)} tokens and {max_new_tokens} new ones needs")
        return ids, counts

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, temperature=0, top_k=None, vocab_size=None):
        """Each prompt's max_new_tokens new tokens (one number for all, or a list, one a prompt), sampled as
        model.sample samples (temperature 0: greedy; vocab_size: only ids below it, as decode.stream)."""
        prompts, max_new_tokens = self.check(prompts, max_new_tokens, temperature, top_k, vocab_size)
        try:
            return self.serve(prompts, max_new_tokens, temperature, top_k, vocab_size)
        finally:  # a call that raised gives back what its requests hold: the next finds the engine as
            for seq in list(self.cache.tables):  # this one did
                self.cache.release(seq)

    def serve(self, prompts, max_new_tokens, temperature, top_k, vocab_size):
        """generate's run, on arguments it has checked."""
        requests = [Request(i, *request) for i, request in enumerate(zip(prompts, max_new_tokens))]
        waiting = deque(sorted(requests, key=lambda r: -r.max_new_tokens))  # the most tokens to decode first
        running, done, per_token = [], {}, []  # running: oldest first; per_token: each request's seconds
        stats = self.stats = dict(peak_in_flight=0, preemptions=0, forwards=0, shared_tokens=0, new_tokens=0,
                                  decode_forwards=0, decode_rows=0, decode_positions=0, decode_seconds=0.0)
        begin = self.clock()

        def draw(logits):  # (B, vocab) -> (B,) the next tokens
            return sample(logits[:, :vocab_size], temperature, top_k)[:, 0]

        while waiting or running:
            self.admit(waiting, running)
            budget = self.chunk
            for request in [r for r in running if r.to_prefill()]:
                if budget == 0:
                    break
                if self.share_prefixes and request.cached == 0:  # its first chunk: the blocks of its
                    # beginning that others wrote, shared
                    request.cached = self.cache.attach(request.id, request.context())
                    stats["shared_tokens"] += request.cached
                n = min(budget, request.to_prefill())
                if request in running and self.make_room(request, n, waiting, running):  # not preempted
                    budget -= n
                    self.forward([request], request.context()[request.cached:request.cached + n], draw,
                                 last=request.cached + n == len(request.context()))
            ready = [r for r in running if r.out and not r.to_prefill() and len(r.out) < r.max_new_tokens]
            decoding = [r for r in ready if r in running and self.make_room(r, 1, waiting, running)]
            if decoding:
                stats["peak_in_flight"] = max(stats["peak_in_flight"], len(running))
                stats["decode_positions"] += sum(r.cached + 1 for r in decoding)  # each row's, this one's too
                t0 = self.clock()
                self.forward(decoding, [r.out[-1] for r in decoding], draw, last=True)
                stats["decode_seconds"] += self.clock() - t0
                stats["decode_forwards"] += 1
                stats["decode_rows"] += len(decoding)
            for request in [r for r in running if len(r.out) == r.max_new_tokens]:
                running.remove(request)
                self.cache.release(request.id)
                done[request.id] = request.out
                per_token.append((self.clock() - request.first) / max(1, request.max_new_tokens - 1))
        stats["seconds"] = self.clock() - begin
        stats["new_tokens"] = sum(map(len, done.values()))
        # a request's time per new token after its first, the mean over requests
        stats["mean_s_per_token"] = sum(per_token) / len(per_token)
        return [done[i] for i in range(len(prompts))]

    def admit(self, waiting, running):
        """Waiting requests join, first in line first, while the pool holds their whole context's blocks
        beside those that the joined requests' contexts still need (their prefills to come)."""
        promised = sum(self.cache.blocks_needed(r.id, r.to_prefill()) for r in running if r.to_prefill())
        while waiting:
            request = waiting[0]  # alone, any request fits (check)
            needed = self.cache.blocks_needed(request.id, len(request.context()))
            if running and promised + needed + len(running) > len(self.cache.free):
                break
            promised += needed
            running.append(waiting.popleft())

    def make_room(self, request, T, waiting, running):
        """Blocks for request's next T tokens, preempting the newest running requests while the pool lacks
        them; False where request itself was the newest, preempted."""
        while not self.cache.grow(request.id, T):
            victim = running.pop()
            self.cache.release(victim.id)
            victim.cached = 0  # recomputed from its prompt and what it has drawn
            waiting.appendleft(victim)
            self.stats["preemptions"] += 1
            if victim is request:
                return False
        return True

    def forward(self, requests, tokens, draw, last):
        """One forward of requests' rows: a chunk of one request's context (tokens, a list), or one token each
        (tokens, one a request); where last, each request draws its next token from the last logits."""
        T = len(tokens) // len(requests)
        idx = torch.tensor(tokens, device=self.model.rope.device).view(len(requests), T)
        self.cache.select([r.id for r in requests])
        logits = self.model(idx, cache=self.cache)[0][:, -1]  # (B, vocab)
        self.stats["forwards"] += 1
        for request in requests:
            request.cached += T
            if self.share_prefixes:
                self.cache.publish(request.id, request.context())
        if last:
            for request, token in zip(requests, draw(logits).tolist()):
                request.out.append(token)
                request.first = request.first or self.clock()
