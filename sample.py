"""
Sample text from a checkpoint written by train.py, printing each token as it is drawn.

    python sample.py out/demo/mha/ckpt.pt                        # a new document, on the best device
    python sample.py out/demo/lrkv-r8/ckpt.pt --prompt="def " --temperature=0 --device=cpu
    python sample.py out/mqa/ckpt.pt --prompt=FILE:prompt.txt --num_samples=5 --max_new_tokens=500
    python sample.py out/demo/lrkv-r8/ckpt.pt --prompts=prompts.txt --kv_budget=4 --kv_quant=int8

The checkpoint holds its data's tokenizer, which encodes the prompt and decodes the samples. A
sample ends after max_new_tokens or at the end-of-text token. The model sees at most its
block_size last tokens: a longer prompt is cropped to them, as nanoGPT's sample.py crops it, and
a sample that grows past block_size goes on from its most recent half (decode.stream). The last
line gives the decoding speed and the KV cache each sample allocates (model.py's kv_cache_bytes),
block_size tokens at most.

--prompts=FILE samples a prompt for each of the file's lines, all of them at once: continuous
batching (lib/attention/engine.py) over a paged cache of --kv_budget MiB, each sample printed when
all are drawn, in the file's order; a prompt and its max_new_tokens must fit in block_size.
"""

import argparse
import codecs
import math
import os
import sys
import time

import torch

from lib.attention.decode import compiled_decode, exact_step, stream
from lib.attention.engine import Engine
from lib.evaluation.runs import layout
from lib.training.data import load_tokenizer
from lib.training.checkpoint import load_checkpoint
from lib.attention import quant
from lib.training.configurator import ArgumentParser, ConfigError, kv_quant, positive_int, run_main, seed
from lib.training.hardware import DEVICES, check_environment, decoding_dtype, pick_device


def top_k(text):
    return None if text == "none" else positive_int(text)


def temperature(text):
    t = float(text)
    if not 0 <= t < math.inf:  # nan fails this too
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number >= 0")
    return t


FILE_LIMIT = 2**26  # the bytes a prompt file may hold (64 MiB), so that an endless one (/dev/zero) ends


def read_file(path, flag):  # flag: the flag that names it, as given
    try:
        with open(path, "rb") as f:
            data = f.read(FILE_LIMIT + 1)
    except OSError as e:
        raise ConfigError(f"{flag}: {e.strerror}") from None
    if len(data) > FILE_LIMIT:
        raise ConfigError(f"{flag}: more than {FILE_LIMIT >> 20} MiB, too long for prompts (an endless "
                          f"file?)")
    return data


def prompt_lines(path):
    """--prompts' file as its lines, or a ConfigError of one line where it holds none or is not text."""
    flag = f"--prompts={path}"
    data = read_file(path, flag)
    if not data:
        raise ConfigError(f"{flag}: the file is empty: give a prompt a line")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad, why = e.start, f"byte {e.start} ({data[e.start]:#04x}) is not UTF-8"
    else:
        if b"\0" not in data:
            return data.splitlines()
        bad, why = data.index(b"\0"), "it holds a NUL byte"
    line = data.count(b"\n", 0, bad) + 1
    raise ConfigError(f"{flag}: line {line} is not text: {why}")


def memory_bytes(device):
    """The memory that device's tensors take theirs from: a GPU's own, else the machine's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "mps":
        return torch.mps.recommended_max_memory()
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def mib(text):
    n = float(text)
    if not 0 < n < math.inf:  # nan fails this too
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number of MiB > 0")
    return n


def encode_prompt(prompt, tok):
    """The prompt's tokens, from its bytes: a file's for FILE:path, else the command line's, which
    Python holds as text, the bytes that are not UTF-8 as lone surrogates (os.fsencode gives them
    back)."""
    if prompt.startswith("FILE:"):
        return encode_bytes(read_file(prompt.removeprefix("FILE:"), f"--prompt={prompt}"), tok)
    return encode_bytes(os.fsencode(prompt), tok)


def encode_bytes(data, tok):
    """A prompt's tokens from its bytes. The byte tokenizer takes any bytes as they are; GPT-2's
    encodes text, so it refuses a prompt that is not UTF-8."""
    # end-of-text opens every document in the shards: a prompt is the start of one
    if tok.name == "byte":
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:  # the byte tokenizer reads bytes as they are: say so
            print(f"sample.py: --prompt: byte {e.start} ({data[e.start]:#04x}) is not UTF-8: the byte "
                  f"tokenizer reads the prompt's {len(data)} bytes as they are", file=sys.stderr)
        return [tok.eot_id, *tok.encode_bytes(data).tolist()]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--prompt: byte {e.start} ({data[e.start]:#04x}) is not UTF-8, and the {tok.name} "
                          "tokenizer encodes text: give the prompt in UTF-8") from None
    return [tok.eot_id, *tok.encode_batch([text])[0].tolist()]


def size(n_bytes):
    return f"{n_bytes / 2**20:.1f} MiB" if n_bytes >= 2**20 else f"{n_bytes / 2**10:.1f} KiB"


def main(argv=None):
    """Sample; the exit code: 0 done, 2 bad input (a bad flag exits from parsing, with argparse's 2)."""
    parser = ArgumentParser(prog="sample.py", description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("ckpt", help="a ckpt.pt written by train.py")
    parser.add_argument("--prompt", default="",
                        help="the text to continue, or FILE:path for a file's; default: a new document. "
                             "One longer than the model's block_size is cropped to its last block_size "
                             "tokens, as nanoGPT's sample.py crops it")
    parser.add_argument("--num_samples", type=positive_int, default=1)
    parser.add_argument("--max_new_tokens", type=positive_int, default=200,
                        help="as many as wanted: past the model's block_size the context goes on from its "
                             "most recent half (decode.stream)")
    parser.add_argument("--temperature", type=temperature, default=0.8,
                        help="0: greedy; one so small that only the likeliest token is left is greedy too")
    parser.add_argument("--top_k", type=top_k, default=200,
                        help="draw from the k likeliest tokens; none: from all")
    parser.add_argument("--seed", type=seed, default=0, help="0 to 2**64 - 1")
    parser.add_argument("--device", default="auto",
                        help=f"{', '.join(DEVICES)}; auto: cuda, else mps, else cpu")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="weights and KV cache; auto: float32 for a run trained in it by choice "
                             "(--dtype=float32, as config/demo.py), else the precision policy's for decoding")
    parser.add_argument("--no_cache", action="store_true",
                        help="decode without the KV cache: every step reads the whole sequence again")
    parser.add_argument("--kv_quant", type=kv_quant, default="none",
                        help="the KV cache's storage (lib/attention/quant.py): none (--dtype's), int8, int4")
    parser.add_argument("--prompts", default=None,
                        help="a file of prompts, one a line, sampled all at once by continuous batching "
                             "(lib/attention/engine.py) within --kv_budget")
    parser.add_argument("--kv_budget", type=mib, default=64.0,
                        help="with --prompts: the MiB of the paged KV cache that the samples share")
    parser.add_argument("--compile", action="store_true",
                        help="compile the single-token step once, on fixed shapes (CUDA graphs on a GPU). "
                             "On a 2-core CPU compiling took 50 s with an empty compile cache, 7 s with a "
                             "warm one, and a demo model's step then 0.9 ms instead of 3-5 ms "
                             "(docs/decoding.md)")
    args = parser.parse_args(argv)
    try:
        check_environment()
        device = pick_device(args.device, 0)
        if args.compile and args.no_cache:
            raise ConfigError("--compile compiles the cached single-token step: it cannot go with --no_cache")
        if args.no_cache and args.kv_quant != "none":
            raise ConfigError(f"--kv_quant={args.kv_quant} stores the KV cache: it cannot go with --no_cache")
        if args.prompts is not None:  # the file and the budget checked before the model loads
            for flag, given in (("--prompt", args.prompt), ("--no_cache", args.no_cache),
                                ("--compile", args.compile), ("--num_samples", args.num_samples > 1)):
                if given:
                    raise ConfigError(f"--prompts samples each line of its file once: not with {flag}")
            lines = prompt_lines(args.prompts)
            if args.kv_budget * 2**20 > memory_bytes(device):
                raise ConfigError(f"--kv_budget={args.kv_budget:g}: more than the "
                                  f"{size(memory_bytes(device))} of memory that this {device.type} has")
        ckpt, model = load_checkpoint(args.ckpt, device)
        tok = load_tokenizer(args.ckpt, ckpt)
        prompt = encode_prompt(args.prompt, tok)
        if args.prompts is not None:
            prompts = [encode_bytes(line, tok) for line in lines]
            L = model.config.block_size
            for i, tokens in enumerate(prompts):
                if len(tokens) > L:
                    raise ConfigError(f"--prompts={args.prompts}: line {i + 1} has {len(tokens)} tokens, "
                                      f"more than the model's context, block_size = {L}")
        dtype, why = ((getattr(torch, args.dtype), "--dtype") if args.dtype != "auto"
                      else decoding_dtype(ckpt.get("config", {}).get("dtype"), device))
    except ConfigError as e:
        print(f"sample.py: {e}", file=sys.stderr)
        return 2

    dtype_name = str(dtype).removeprefix("torch.")
    cache_class = quant.cache_class(args.kv_quant)
    if args.prompts is not None:
        return serve(model.to(dtype).eval(), prompts, tok, args, cache_class, dtype)
    cache_len = min(model.config.block_size, len(prompt) + args.max_new_tokens)  # decode.stream's cache
    cache_bytes = model.kv_cache_bytes(1, cache_len, dtype, cache_class)
    storage = dtype_name if args.kv_quant == "none" else f"{args.kv_quant}, scales in {dtype_name}"
    shared = layout(model.config)  # sharing and windows, which the cache's size follows
    cache = ("no KV cache (--no_cache)" if args.no_cache else f"KV cache {size(cache_bytes)} "
             f"({storage}, 1 x {cache_len} tokens{'; ' + shared if shared else ''})")
    print(f"precision: {dtype_name} weights ({why}) | {cache}", flush=True)
    model.to(dtype).eval()
    # seeded after loading, whose model init draws from the RNG: seed s draws what generate() does
    # after torch.manual_seed(s)
    torch.manual_seed(args.seed)
    idx = torch.tensor([prompt], device=device)
    drawn, t0 = 0, time.perf_counter()
    for _ in range(args.num_samples):
        # byte tokens can split a character: the decoder holds its first bytes until it is whole
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        print(text.decode(tok.decode_bytes(prompt)), end="", flush=True)
        step = None if args.no_cache else compiled_decode if args.compile else exact_step
        for token in stream(model, idx, args.max_new_tokens, args.temperature, args.top_k, not args.no_cache,
                            step, tok.vocab_size, cache_class):
            drawn += 1
            if token.item() == tok.eot_id:
                break  # the document ends here: the tokens after it would start an unrelated one
            print(text.decode(tok.decode_bytes(token[0].tolist())), end="", flush=True)
        print(text.decode(b"", final=True) + "\n---------------")
    seconds = time.perf_counter() - t0
    print(f"{args.num_samples} sample{'s' * (args.num_samples > 1)}, {drawn} tokens in {seconds:.1f} s"
          f"{' (compiling included)' if args.compile else ''}: {drawn / seconds:.0f} tokens/s | {cache}")
    return 0


def serve(model, prompts, tok, args, cache_class, dtype):
    """--prompts: every prompt's sample, drawn together by the engine, each printed up to its end-of-text."""
    torch.manual_seed(args.seed)
    try:
        engine = Engine(model, int(args.kv_budget * 2**20), cache_class, dtype)
        samples = engine.generate(prompts, args.max_new_tokens, args.temperature, args.top_k, tok.vocab_size)
    except ValueError as e:
        print(f"sample.py: {e}", file=sys.stderr)
        return 2
    for prompt, new in zip(prompts, samples):
        new = new[:new.index(tok.eot_id)] if tok.eot_id in new else new
        print(tok.decode_bytes(prompt + new).decode("utf-8", errors="replace") + "\n---------------")
    stats, budget = engine.stats, size(int(args.kv_budget * 2**20))
    storage = args.kv_quant if args.kv_quant != "none" else str(dtype).removeprefix("torch.")
    print(f"{len(prompts)} prompts, {stats['new_tokens']} tokens in {stats['seconds']:.1f} s: "
          f"{stats['new_tokens'] / stats['seconds']:.0f} tokens/s | paged KV cache {budget} ({storage}), "
          f"at most {stats['peak_in_flight']} sequences at once, {stats['preemptions']} preempted")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
