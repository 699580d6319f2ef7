"""lib/attention/quant.py: int8 and int4 storage against quantisers written out here, entry by entry and
slot by slot (KIVI's key groups filling and wrapping around a ring); every decoding path (the plain cached
path, the exact steps, the fixed-shape step) on a quantised cache against the plain path on it, for every
variant with and without shared keys and windows; the bytes at 128M; bad input in one line. The stores and
the steps that read codes run twice where a CPU's C build is at hand (`reads`): through quant.c, and
through PyTorch's ops alone, as on a machine without a compiler."""

import json
import math
import os
import shutil
import subprocess
import threading
import time

import pytest
import torch

import train

from lib.attention import decode as decode_module
from lib.attention import quant_c
from lib.attention.decode import ExactKVCache, FixedKVCache
from lib.attention.quant import CACHES, KEYS, Int4KVCache, Int8KVCache, cache_class
from lib.attention.ring import RingKVCache
from model import GPT, GPTConfig, VARIANTS
from lib.training.checkpoint import load_checkpoint
from references import TINY, tiny_model
from test_train import data_dir, flags  # noqa: F401 (data_dir is a fixture)
from tools import quant_frontier

class Int4Groups4(Int4KVCache):
    group = 4  # key groups that fill and wrap within the tests' few positions


class Float16KVCache(RingKVCache):
    """A new storage as a user would write one, one method on the cache interface and no line of model.py:
    every entry held in float16, whatever the cache's dtype (store casts into the buffer, load back)."""

    def allocate(self, shapes, length, device):
        return {name: torch.zeros(self.batch_size, length, *shape, dtype=torch.float16, device=device)
                for name, shape in shapes.items()}


LAYOUTS = {"plain": {}, "cla2": dict(cla=2), "window": dict(window=5, window_pattern="SL")}


@pytest.fixture(params=["c", "torch"])
def reads(request, monkeypatch):
    """quant.c's reads and stores ("c", where this machine builds it), or PyTorch's alone ("torch")."""
    if request.param == "torch":
        monkeypatch.setattr(quant_c, "takes", lambda *tensors: False)
    elif quant_c.library() is None:
        pytest.skip("no C compiler builds quant.c here (test_quant_c_builds_where_a_compiler_is says so)")
    return request.param


def test_quant_c_builds_where_a_compiler_is(tmp_path, monkeypatch, capfd):
    """Where the system has a C compiler, quant.c builds and loads; without one (or with LRKV_C_KERNELS=0)
    none is built, nothing is left behind, and quant.py's PyTorch reads stand in."""
    if shutil.which(os.environ.get("CC", "cc")):
        assert quant_c.library() is not None
    monkeypatch.setenv("CC", str(tmp_path / "no-compiler"))
    with pytest.raises(quant_c.BuildError, match="no-compiler"):
        quant_c.build(str(tmp_path), str(tmp_path / "quant.so"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("compiler", ["true", "false", "no-compiler"])
def test_quant_c_falls_back_in_one_line_where_no_build_loads(compiler, tmp_path, monkeypatch, capfd):
    """A compiler that writes nothing and says it succeeded (CC=true), one that fails, and none at all:
    load() is None, says so in one line on stderr, and leaves no object, whole or part, behind."""
    monkeypatch.setenv("CC", compiler if compiler != "no-compiler" else str(tmp_path / compiler))
    capfd.readouterr()
    assert quant_c.load(str(tmp_path / "cache")) is None
    err = capfd.readouterr().err
    assert err.startswith("warning: quant.c is not built") and err.count("\n") == 1, err
    assert list((tmp_path / "cache").iterdir()) == []


def copying_compiler(tmp_path, good):
    """A C compiler that writes the object good to its -o argument, and notes that it ran."""
    script = tmp_path / "cc"
    script.write_text(f'#!/bin/sh\necho ran >> "{tmp_path}/ran"\n'
                      f'while [ $# -gt 0 ]; do [ "$1" = -o ] && cp "{good}" "$2"; shift; done\n')
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "no functions"])
def test_quant_c_builds_again_over_a_broken_cached_object(damage, tmp_path, monkeypatch, capfd):
    """A cached object a build killed midway or a full disk left (empty, cut in half, not ELF) or one of
    another source (no quant.c functions): built again and loaded, the object in place whole, no line
    said; where the build again fails too, PyTorch's ops stand in (one line, as above). A half object is
    never opened in this process (one cut in half faults on a read of its memory: SIGBUS)."""
    if quant_c.library() is None:
        pytest.skip("no C compiler builds quant.c here")
    good = quant_c.object_path(os.path.dirname(quant_c.library()._name))
    with open(good, "rb") as f:
        data = f.read()
    other = tmp_path / "other.so"  # a whole object that is not quant.c's
    assert subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-x", "c", "-", "-o", str(other)],
                          input=b"int other(void) { return 1; }\n").returncode == 0
    broken = {"empty": b"", "truncated": data[:len(data) // 2], "garbage": os.urandom(len(data)),
              "no functions": other.read_bytes()}[damage]
    folder = tmp_path / "cache"
    folder.mkdir()
    path = quant_c.object_path(str(folder))
    with open(path, "wb") as f:
        f.write(broken)
    assert quant_c.whole(path) == (damage == "no functions")
    monkeypatch.setenv("CC", copying_compiler(tmp_path, good))
    capfd.readouterr()
    lib = quant_c.load(str(folder))
    assert lib is not None and lib.int8_store is not None and capfd.readouterr().err == ""
    assert (tmp_path / "ran").read_text() == "ran\n" and os.listdir(folder) == [os.path.basename(path)]
    with open(path, "rb") as f:
        assert f.read() == data
    elsewhere = tmp_path / "elsewhere"  # broken again, and no compiler to build it: PyTorch's ops
    elsewhere.mkdir()
    with open(quant_c.object_path(str(elsewhere)), "wb") as f:
        f.write(broken)
    monkeypatch.setenv("CC", "true")
    assert quant_c.load(str(elsewhere)) is None and capfd.readouterr().err.count("\n") == 1


def test_quant_c_never_shows_a_half_written_object(tmp_path, monkeypatch):
    """A build writes its own file and renames it into place whole: a process reading the cache while
    another builds (here a compiler that writes half the object, waits, then the rest) finds no object
    or a whole one, never part of one."""
    if quant_c.library() is None:
        pytest.skip("no C compiler builds quant.c here")
    good = quant_c.object_path(os.path.dirname(quant_c.library()._name))
    half = tmp_path / "half"
    half.write_bytes(open(good, "rb").read()[:1000])
    script = tmp_path / "cc"
    script.write_text(f'#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
                      f'cp "{half}" "$out"; sleep 0.5; cp "{good}" "$out"\n')
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))
    folder = tmp_path / "cache"
    path = quant_c.object_path(str(folder))
    builder = threading.Thread(target=quant_c.build, args=(str(folder), path))
    builder.start()
    seen = set()
    while builder.is_alive():
        seen.add("none" if not os.path.exists(path) else "whole" if quant_c.whole(path) else "part")
        time.sleep(0.01)
    builder.join()
    assert seen <= {"none", "whole"} and quant_c.whole(path)


def int8_reference(x, dtype):
    """Symmetric absmax per row (the last dim), the scale rounded to dtype as stored."""
    scale = (x.abs().amax(-1, keepdim=True) / 127).to(dtype).float()
    return torch.round(x / scale.clamp(min=1e-38)).clamp(-127, 127) * scale


def int4_reference(x, dims, dtype):
    """Asymmetric min-max over dims, 16 levels, the low and scale rounded to dtype as stored."""
    low, high = x.amin(dims, keepdim=True), x.amax(dims, keepdim=True)
    low, scale = low.to(dtype).float(), ((high - low) / 15).to(dtype).float()
    return torch.round((x - low) / scale.clamp(min=1e-38)).clamp(0, 15) * scale + low


class Cache:
    """A quantised cache of one layer that owns its entries, on a model whose cache_shapes are given."""

    def __init__(self, cls, shapes, length, batch=2, dtype=torch.bfloat16):
        model = tiny_model("mha", n_layer=1)
        model.blocks[0].attn.cache_shapes = lambda: shapes
        self.cache = cls(model, batch, length, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_stores_each_row_as_its_absmax_quantiser(dtype, reads):
    shapes = {"k": (2, 8), "rho": (2,), "c": (6,)}
    cache = Cache(Int8KVCache, shapes, 7, dtype=dtype).cache
    entries = {name: torch.randn(2, 3, *shape) for name, shape in shapes.items()}
    cache.store(0, torch.tensor([4, 5, 6]), entries)
    loaded = cache.load(0, torch.tensor([4, 5, 6]))
    for name, x in entries.items():
        expected = x.to(dtype).float() if name == "rho" else int8_reference(x, dtype)
        assert torch.equal(loaded[name], expected), name


def test_int4_stores_values_per_token_and_keys_per_channel_over_groups_as_they_fill_and_wrap(reads):
    """A ring of 10 slots, key groups of 4 (slots 0-3, 4-7, 8-9), written one position at a time for 23
    positions, and once a chunk of 3: after every write, a slot whose group has filled since the slot was
    written holds the group's per-channel quantisation (over the values its slots held then); any other
    slot of the group being filled, its value in full precision; a value entry, its per-token quantisation."""
    length, G = 10, Int4Groups4.group
    shapes = {"k": (2, 8), "v": (2, 64), "r_v": (3, 6)}
    cache = Cache(Int4Groups4, shapes, length, batch=1).cache
    held = {}  # slot: the bf16 value it holds
    quantised = {}  # slot: what its group's quantisation made of it, for groups that filled
    writes = [[p] for p in range(20)] + [[20, 21, 22]]
    for positions in writes:
        slots = torch.tensor([p % length for p in positions])
        entries = {name: torch.randn(1, len(positions), *shape) for name, shape in shapes.items()}
        cache.store(0, slots, entries)
        for t, slot in enumerate(slots.tolist()):
            held[slot] = entries["k"][0, t].to(torch.bfloat16).float()
            quantised.pop(slot, None)
            group = range(slot - slot % G, min(slot - slot % G + G, length))
            if slot == group[-1]:  # the group is full: quantised whole, per channel
                values = torch.stack([held[s] for s in group])  # (slots, 2, 8)
                for s, q in zip(group, int4_reference(values, 0, torch.bfloat16)):
                    quantised[s] = q
        loaded = cache.load(0, torch.arange(length))
        for slot in held:
            expected = quantised.get(slot, held[slot])
            assert torch.equal(loaded["k"][0, slot], expected), (positions, slot)
        last = slots[-1:]
        x = entries["v"][:, -1:].float()
        assert torch.equal(cache.load(0, last)["v"], int4_reference(x, (-1,), torch.bfloat16))
        x = entries["r_v"][:, -1:].float()  # rows of 6: a group spans the entry's last two dims
        assert torch.equal(cache.load(0, last)["r_v"], int4_reference(x, (-2, -1), torch.bfloat16))


def decode(model, idx, prefix, cls, path, dtype=torch.float64):
    """idx's logits from position prefix on, through a cache of cls in dtype: a prefill, then each token by
    the plain cached path, an exact view or a fixed-shape view over the same cache."""
    cache = model.new_cache(idx.size(0), idx.size(1), dtype, cache_class=cls)
    logits = [model(idx[:, :prefix], cache=cache)[0]]
    cache = {"plain": lambda cache: cache, "exact": ExactKVCache, "fixed": FixedKVCache}[path](cache)
    for t in range(prefix, idx.size(1)):
        logits.append(model(idx[:, t:t + 1], cache=cache)[0])
        if path == "fixed":
            cache.pos += 1
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("cls", [Int8KVCache, Int4Groups4, Float16KVCache], ids=["int8", "int4", "fp16"])
@pytest.mark.parametrize("attn", VARIANTS)
def test_every_path_decodes_a_quantised_cache_as_the_plain_path_does(attn, cls):
    """On the entries a quantised cache holds, the exact steps and the fixed-shape step (those of MHA, GQA,
    MQA, LRKV and MLA reading the codes themselves) give the plain path's logits (keys and values rebuilt
    from the dequantised entries, attended plainly), to fp64 rounding: in fp32, a path's rounding may move
    a later layer's entry across a code's boundary (the next test compares the reads on the same codes);
    and the quantised cache is not the unquantised one (the test sees quantisation). A storage of one
    method (Float16KVCache) holds for every variant, layout and path as well."""
    idx = torch.randint(0, TINY.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    for layout, knobs in LAYOUTS.items():
        model = tiny_model(attn, n_layer=4, **knobs).double()
        with torch.no_grad():
            plain = decode(model, idx, 12, cls, "plain")
            for path in ("exact", "fixed"):
                torch.testing.assert_close(decode(model, idx, 12, cls, path), plain, atol=1e-6, rtol=1e-6,
                                           msg=f"{layout} {path}")
            assert not torch.allclose(plain, model(idx)[0], atol=1e-6, rtol=0), layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [Int8KVCache, Int4Groups4], ids=["int8", "int4"])
@pytest.mark.parametrize("attn", ["mha", "gqa", "mqa", "lrkv", "mla"])
def test_the_steps_that_read_codes_give_what_they_give_on_the_dequantised_entries(attn, cls, dtype, reads,
                                                                                   monkeypatch):
    """At every step of a decode (with --cla=2 and windows, the exact and the fixed-shape path), a step of
    decode.CODE_STEPS handed the cache's codes (quant.Codes: quant.c's reads or PyTorch's, `reads`) gives
    what it gives on load's dequantised entries of the same slots, its plain equation (test_decode.py checks
    that against reference_step): to fp32 rounding, or to bf16's in a cache of bf16 (without a layout: the
    layouts change which slots are read, not how). 32 positions: in bf16 the kernel reads rows of a whole
    number of 16, the weighted sums' over every slot."""
    idx = torch.randint(0, TINY.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    code_steps = {cls: step for cls, step in decode_module.STEPS.items() if step in decode_module.CODE_STEPS}
    for layout, knobs in (LAYOUTS if dtype == torch.float32 else {"plain": {}}).items():
        model = tiny_model(attn, n_layer=4, **knobs).to(dtype)
        for path in ("exact", "fixed"):
            read = []
            cache = model.new_cache(idx.size(0), idx.size(1), dtype, cache_class=cls)

            def both(step):
                def checked(attn, q, cached, rope, mask):
                    got = step(attn, q, cached, rope, mask)
                    read.append(sum(not torch.is_tensor(x) for x in cached.values()))
                    expected = step(attn, q, cache.load(attn.layer, slice(0, rope.size(0))), rope, mask)
                    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance,
                                               msg=f"{layout} {path}")
                    return got
                return checked

            steps = {cls: both(step) for cls, step in code_steps.items()}
            monkeypatch.setattr(decode_module, "STEPS", {**decode_module.STEPS, **steps})
            monkeypatch.setattr(decode_module, "CODE_STEPS", set(steps.values()))
            with torch.no_grad():
                model(idx[:, :24], cache=cache)
                view = {"exact": ExactKVCache, "fixed": FixedKVCache}[path](cache)
                for t in range(24, idx.size(1)):
                    model(idx[:, t:t + 1], cache=view)
                    if path == "fixed":
                        view.pos += 1
            assert len(read) == 8 * 4 and min(read) > 0, (layout, path, read)  # every layer, on codes


@pytest.mark.parametrize("attn", ["mha", "lrkv"])
def test_the_bytes_at_128m_count_every_scale(attn):
    """int8 at most 53% of bf16's bytes, int4 at most 30%, at the 128M shape and its context; and
    kv_cache_bytes is the buffers' bytes, scales, lows, residuals and all."""
    with torch.device("meta"):
        model = GPT(GPTConfig(attn=attn))
    bf16 = model.kv_cache_bytes(1, 2048, torch.bfloat16)
    int8 = model.kv_cache_bytes(1, 2048, torch.bfloat16, Int8KVCache)
    int4 = model.kv_cache_bytes(1, 2048, torch.bfloat16, Int4KVCache)
    assert int8 <= 0.53 * bf16 and int4 <= 0.30 * bf16
    # int8 by its formula: a byte an element, a bf16 scale a row, rho in bf16
    shapes = model.blocks[0].attn.cache_shapes()
    per_token = sum(2 * math.prod(shape) if name == "rho" else math.prod(shape) + 2 * math.prod(shape[:-1])
                    for name, shape in shapes.items())
    assert int8 == 12 * 2048 * per_token
    assert {name for name in shapes if name in KEYS} >= {"k"} if attn == "mha" else {"k_shared", "r_k"}


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match=r"^--kv_quant='int3': must be one of none, int8, int4$"):
        cache_class("int3")
    assert set(CACHES) == {"none", "int8", "int4"}
    model = tiny_model("lrkv", lrkv_rank=3)  # r_k (H, 3): two codes a byte cannot split 3
    with pytest.raises(ValueError, match=r"^an int4 cache packs two codes a byte: entry r_k is 3 wide, odd$"):
        model.new_cache(1, 8, cache_class=Int4KVCache)


def test_the_frontier_tool_measures_each_storage_as_training_and_decoding_do(data_dir, tmp_path, capsys):
    """tools/quant_frontier.py on a checkpoint that train.py wrote: through an fp32 cache, the validation
    loss and bits per byte are train.py's own of the full forward (the teacher-forced steps are exact);
    each storage's bytes are kv_cache_bytes of its class; fp32's greedy text departs from nothing; a
    checkpoint that is not there is one line, before any is analysed."""
    out = tmp_path / "run"
    assert train.main(flags(data_dir=data_dir, out_dir=out, max_steps=2)) == 0
    assert quant_frontier.main([str(out / "ckpt.pt"), f"--out_dir={tmp_path}", "--batch_size=4"]) == 0
    run = json.loads((tmp_path / "quant_frontier.json").read_text())["runs"][0]
    ckpt, model = load_checkpoint(out / "ckpt.pt", "cpu")
    fp32 = run["storages"]["fp32"]
    assert fp32["val_loss"] == pytest.approx(ckpt["val_loss"], rel=1e-5)
    assert fp32["val_bpb"] == pytest.approx(ckpt["val_bpb"], rel=1e-5)
    assert fp32["greedy_departs_at"] is None
    T = model.config.block_size
    for name, cls, dtype in quant_frontier.STORAGES:
        assert run["storages"][name]["bytes_per_token"] == model.kv_cache_bytes(1, T, dtype, cls) / T, name
    assert (tmp_path / "quant_frontier.png").stat().st_size > 0
    capsys.readouterr()
    gone = tmp_path / "gone.pt"
    assert quant_frontier.main([str(out / "ckpt.pt"), str(gone), f"--out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tools/quant_frontier.py: {gone}") and err.count("\n") == 1, err

