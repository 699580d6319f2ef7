"""
quant.c on a CPU: built by the system's C compiler the first time a process asks for it (about a second),
kept in __pycache__ beside it under a name of its source and the machine, and called through ctypes on
tensors' memory. Where no compiler builds it (none installed, or LRKV_C_KERNELS=0), library() is None and
quant.py reads and writes the codes by PyTorch's ops instead: the same numbers, slower. A build is written
to a file of its own, loaded once in another process, and only then renamed into place, so no process sees
a half-written or broken object; a cached object that is not whole (empty, truncated, not ELF) or does not
load is built again, and where no build loads, one line on stderr says so and PyTorch's ops stand in.
"""

import concurrent.futures
import ctypes
import functools
import hashlib
import os
import platform
import struct
import subprocess
import sys
import tempfile

import torch

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quant.c")
# the host's own vector instructions where the compiler knows them; else the portable build
FLAGS = (["-O3", "-march=native"], ["-O3"])
LIBRARIES = ["-lm"]
SIGNATURES = {  # argument types of each function, in quant.c's order
    "int4_key_dot": "l i i p i l p l p p i l l p p i l l",
    "int4_key_scores": "l i i i p p l p p i l p p i l l p",
    "int4_weighted_sum": "l i i i p i p l p p i l l p p",
    "int8_key_dot": "l i i p i l p l p i l l p",
    "int8_store": "l l l i p i p p l l l l p i l l l",
    "int4_store": "l l l i l p i p p l l l l p p i l l l",
    "paged_gqa_decode": "l l l i i i p p p p i p p i f p p",
    "int8_gather": "l l i p p i p p i",
    "int4_gather": "l l i p p p i p l l i p i",
}
C_TYPES = {"l": ctypes.c_long, "i": ctypes.c_int, "p": ctypes.c_void_p, "f": ctypes.c_float}


def machine():
    """What a build depends on beside its source: the processor's features where the system lists them."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.machine() + platform.processor()


@functools.cache
def library():
    """quant.c's functions, built once a source and machine, or None where they cannot be."""
    if os.environ.get("LRKV_C_KERNELS", "1") == "0":
        return None
    return load(os.path.join(os.path.dirname(SOURCE), "__pycache__"))


def load(folder):
    """quant.c's functions from folder's object of this source and machine, built (again) where none is
    there or the one there is not whole or does not load; None, said in one line on stderr, where no
    build loads."""
    path = object_path(folder)
    lib = opened(path) if whole(path) else None
    if lib is None:
        try:
            lib = build(folder, path)
        except BuildError as e:
            print(f"warning: quant.c is not built ({e}): PyTorch's ops read and write the quantised "
                  f"caches instead, slower", file=sys.stderr)
    return lib


def object_path(folder):
    """Where folder keeps the object of this source and machine."""
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + machine().encode()).hexdigest()[:16]
    return os.path.join(folder, f"quant-{digest}.so")


def opened(path):
    """The object at path loaded with quant.c's signatures, or None where it does not load or lacks one."""
    try:
        lib = ctypes.CDLL(path)
        for name, signature in SIGNATURES.items():
            getattr(lib, name).argtypes = [C_TYPES[c] for c in signature.split()]
            getattr(lib, name).restype = None
    except (OSError, AttributeError):
        return None
    return lib


def whole(path):
    """Whether path holds a whole ELF object: its header, its tables and every segment the loader maps lie
    within the file (a truncated one would fault on a read of its memory instead of failing to load)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return False
    if len(data) < 52 or data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
        return False
    wide, order = data[4] == 2, "<" if data[5] == 1 else ">"
    # the header's table offsets, entry sizes and counts; a program header's offset and size in the file
    header, segment = (f"{order}32xQQ6xHHHH", f"{order}8xQ16xQ") if wide else (f"{order}28xII6xHHHH",
                                                                                   f"{order}4xI8xI")
    if len(data) < struct.calcsize(header):
        return False
    phoff, shoff, phsize, phnum, shsize, shnum = struct.unpack_from(header, data)
    if phoff + phsize * phnum > len(data) or shoff + shsize * shnum > len(data) or phnum == 0:
        return False
    for i in range(phnum):
        offset, size = struct.unpack_from(segment, data, phoff + i * phsize)
        if offset + size > len(data):
            return False
    return True


class BuildError(Exception):
    """Why no object of quant.c was built."""


def build(folder, path):
    """The shared library at path (or in a temporary folder where folder is read-only), loaded: compiled
    into a file of its own, found whole and loaded in another process, then here (under its own name, as
    a broken object this process opened at path would be found again under that one) and only then
    renamed into place (an atomic replace: a process reading path sees the old object or this one, never
    part of one); BuildError where no compiler builds one that loads."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    except OSError:
        path = os.path.join(tempfile.mkdtemp(), os.path.basename(path))
        fd, partial = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    compiler = os.environ.get("CC", "cc")
    try:
        for flags in FLAGS:
            done = subprocess.run([compiler, *flags, "-shared", "-fPIC", SOURCE, "-o", partial, *LIBRARIES],
                                  capture_output=True)
            if done.returncode == 0 and whole(partial) and subprocess.run(
                    [sys.executable, "-I", "-S", "-c", LOADS, partial, *SIGNATURES],
                    capture_output=True).returncode == 0 and (lib := opened(partial)) is not None:
                os.replace(partial, path)  # another process may have built it too: the same bytes
                return lib
        raise BuildError(f"{compiler} {'failed' if done.returncode else 'wrote no object that loads'}")
    except OSError as e:  # no compiler, or no room to write
        raise BuildError(f"{compiler}: {e.strerror or e}") from None
    finally:
        if os.path.exists(partial):
            os.remove(partial)


# run in another process: loads the object argv[1] and finds each function named after it
LOADS = "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); [getattr(lib, name) for name in sys.argv[2:]]"


def takes(*tensors):
    """Whether the C reads take these tensors: built, all on a CPU, each of fp32, bf16 or bytes, and not
    inside torch.compile's tracing (a compiled step keeps PyTorch's reads, which it can fuse)."""
    kinds = (torch.float32, torch.bfloat16, torch.uint8, torch.int8)
    on_cpu = all(t.device.type == "cpu" and t.dtype in kinds for t in tensors)
    return not torch.compiler.is_compiling() and on_cpu and library() is not None


def numbers(x, rows=False):
    """x as the C reads take numbers, fp32 or bf16 (another dtype in fp32), contiguous (rows: its last dim
    alone, the others as they lie), and whether bf16."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    if x.stride(-1) != 1 or not rows:
        x = x.contiguous()
    return x, int(x.dtype == torch.bfloat16)


def evenly(codes):
    """codes (rows, D, n) with each row's n positions contiguous and the rows evenly apart, as C reads
    them: its pointer and the stride of a row."""
    assert codes.stride(-1) == 1 and codes.stride(0) == codes.size(1) * codes.stride(1)
    return codes.data_ptr(), codes.stride(1)


def int4_key_dot(x, codes, low, scale, group, t0, residual, first, filled):
    """x (H, D, n) fp32 or bf16, each row's n positions contiguous; codes (H, D/2, n) bytes of positions
    t0..t0 + n - 1; low, scale (groups, H, D) from group t0 // group on; residual (group, H, D), holding
    positions first..first + filled - 1; all three in the cache's dtype -> (H, n) fp32: x . (the keys)."""
    H, D, n = x.shape
    (x, x_bf16), (low, ls_bf16), (scale, _), (residual, res_bf16) = (
        numbers(x, rows=True), numbers(low), numbers(scale), numbers(residual))
    assert x.stride(0) == D * x.stride(1)
    out = torch.empty(H, n)
    library().int4_key_dot(n, H, D, x.data_ptr(), x_bf16, x.stride(1), *evenly(codes), low.data_ptr(),
                           scale.data_ptr(), ls_bf16, group, t0, out.data_ptr(), residual.data_ptr(),
                           res_bf16, first, filled)
    return out


def int8_key_dot(x, codes, scale):
    """x (H, D, n) as int4_key_dot's; codes (H, D, n) int8 as it lies; scale (n, H), any strides, in the
    cache's dtype -> (H, n) fp32: s_{t,h} x_{t,h} . c_{t,h}."""
    H, D, n = x.shape
    x, x_bf16 = numbers(x, rows=True)
    assert x.stride(0) == D * x.stride(1)
    out = torch.empty(H, n)
    library().int8_key_dot(n, H, D, x.data_ptr(), x_bf16, x.stride(1), *evenly(codes), scale.data_ptr(),
                           int(scale.dtype == torch.bfloat16), *scale.stride(), out.data_ptr())
    return out


def int4_key_scores(q, codes, low, scale, group, residual, first, filled):
    """q (K, M, D); codes (K, D/2, n) bytes of positions 0..n-1; low, scale (groups, K, D); residual as
    int4_key_dot's -> (K, M, n) fp32: q_{k,r} . (head k's keys)."""
    K, M, D = q.shape
    n = codes.size(-1)
    (low, ls_bf16), (scale, _), (residual, res_bf16) = numbers(low), numbers(scale), numbers(residual)
    q = q.float().contiguous()
    out, room = torch.empty(K, M, n), torch.empty(-(-n // group), M, D)
    library().int4_key_scores(n, K, M, D, q.data_ptr(), *evenly(codes), low.data_ptr(), scale.data_ptr(),
                              ls_bf16, group, out.data_ptr(), residual.data_ptr(), res_bf16, first, filled,
                              room.data_ptr())
    return out


def int4_weighted_sum(p, codes, low, scale):
    """p (K, M, n); codes (K, D/2, n) bytes as int4_key_dot's; low and scale (n, K) per token, any strides,
    in the cache's dtype -> (K, M, D) fp32: sum_t p_t (c_t s_t + m_t) of every row of p."""
    K, M, n = p.shape
    assert low.stride() == scale.stride() and low.dtype == scale.dtype in (torch.float32, torch.bfloat16)
    p, p_bf16 = numbers(p)
    out, room = torch.empty(K, M, 2 * codes.size(1)), torch.empty(M, n)
    library().int4_weighted_sum(n, K, M, out.size(-1), p.data_ptr(), p_bf16, *evenly(codes),
                                low.data_ptr(), scale.data_ptr(), int(low.dtype == torch.bfloat16),
                                *low.stride(), out.data_ptr(), room.data_ptr())
    return out


def stored(x, slots, codes, *scales):
    """What a store in C takes: x (B, T, *rows, D) as numbers, slots (T,) (a slice or an index) as an
    int64 index, the codes (B, L, rows, width) and the scales (B, L, groups), or None where a buffer's
    rows are not one stride apart."""
    B = x.size(0)
    try:
        codes = codes.view(B, codes.size(1), -1, codes.size(-1))
        scales = [t.view(B, t.size(1), -1) for t in scales]
    except RuntimeError:
        return None
    if isinstance(slots, slice):
        slots = torch.arange(codes.size(1))[slots]
    return numbers(x), torch.as_tensor(slots, dtype=torch.int64).contiguous(), codes, scales


def int8_store(x, slots, codes, scale):
    """Int8KVCache.store_entry's quantising, in C: x (B, T, *rows, D) into slots (T,) of codes (B, L,
    *rows, D) int8 and scale (B, L, *rows, 1), held in any layout where the rows are one stride apart;
    False, nothing written, where they are not."""
    taken = stored(x, slots, codes, scale)
    if taken is None:
        return False
    (x, x_bf16), slots, codes, (scale,) = taken
    library().int8_store(x.size(0), x.size(1), codes.size(2), x.size(-1), x.data_ptr(), x_bf16,
                         slots.data_ptr(), codes.data_ptr(), *codes.stride(), scale.data_ptr(),
                         int(scale.dtype == torch.bfloat16), *scale.stride())
    return True


def int4_store(x, slots, codes, low, scale, m):
    """Int4KVCache.store_entry's per-token quantising, in C: x (B, T, *rows, D), each m rows one group,
    into slots (T,) of codes (B, L, *rows, D/2) uint8 and low, scale (B, L, ..., 1[, 1]) a group; False
    as int8_store's."""
    taken = stored(x, slots, codes, low, scale)
    if taken is None:
        return False
    (x, x_bf16), slots, codes, (low, scale) = taken
    library().int4_store(x.size(0), x.size(1), codes.size(2), x.size(-1), m, x.data_ptr(), x_bf16,
                         slots.data_ptr(), codes.data_ptr(), *codes.stride(), low.data_ptr(),
                         scale.data_ptr(), int(low.dtype == torch.bfloat16), *low.stride())
    return True


@functools.cache
def workers(n):
    """n threads that run C calls beside the caller's (shared)."""
    return concurrent.futures.ThreadPoolExecutor(n)


def paged_gqa_decode(q, slots, k, v, k_scale, v_scale, scale):
    """q (B, H, D); slots (B, S) int64, -1 where a row sees no position; the pool's keys and values k, v (n,
    G, D), fp32, bf16 or int8 codes with their scales k_scale, v_scale (n, G) (else None) -> (B, H, D) fp32:
    each row's softmax(scale q . k) v over the slots it sees, read where they lie (quant.c), the rows
    shared among torch's threads (shared)."""
    B, H, D = q.shape
    S, G = slots.size(1), k.size(1)
    kind = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}[k.dtype]
    assert k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype and slots.dtype == torch.int64
    q, slots = q.float().contiguous(), slots.contiguous()
    scales = (k_scale.contiguous(), v_scale.contiguous()) if kind == 2 else (k, v)  # unread unless int8
    scale_bf16 = int(scales[0].dtype == torch.bfloat16)
    out = torch.empty(B, H, D)
    rooms = torch.empty(min(torch.get_num_threads(), B), H * S)
    shared(B, lambda i, b0, b1: library().paged_gqa_decode(
        b0, b1, S, H, G, D, q.data_ptr(), slots.data_ptr(), k.data_ptr(), v.data_ptr(), kind,
        scales[0].data_ptr(), scales[1].data_ptr(), scale_bf16, scale, out.data_ptr(), rooms[i].data_ptr()))
    return out


def shared(n, call):
    """call(i, start, stop) for torch's threads' shares i of range(n), share 0 on this thread, beside the
    others' on workers (ctypes lets go of the GIL for a call: handing every share to workers left two
    threads no faster than one)."""
    threads = max(1, min(torch.get_num_threads(), n))
    bounds = [n * i // threads for i in range(threads + 1)]
    others = [workers(threads - 1).submit(call, i, bounds[i], bounds[i + 1]) for i in range(1, threads)]
    call(0, bounds[0], bounds[1])
    for other in others:
        other.result()


def int8_gather(codes, scale, slots, dtype):
    """Int8KVCache's load_entry of one row's slots (S,) in C, on this thread (shared among torch's threads,
    it gained the engine nothing measurable): codes (L, *shape) int8 and scale (L, *shape[:-1], 1), each
    slot's numbers contiguous -> (S, *shape) c s in dtype (fp32, or bf16 rounded once: the same numbers)."""
    assert codes.is_contiguous() and scale.is_contiguous() and dtype in (torch.float32, torch.bfloat16)
    slots = slots.to(torch.int64).contiguous()
    D, R = codes.size(-1), codes[0].numel() // codes.size(-1)
    out = torch.empty(len(slots), *codes.shape[1:], dtype=dtype)
    library().int8_gather(len(slots), R, D, codes.data_ptr(), scale.data_ptr(),
                          int(scale.dtype == torch.bfloat16), slots.data_ptr(), out.data_ptr(),
                          int(dtype == torch.bfloat16))
    return out


def int4_gather(packed, low, scale, slots, dtype, group=None, rows=1):
    """Int4KVCache's load_entry of one row's slots (S,) in C, on this thread (int8_gather's): packed (L,
    *shape[:-1], d/2) bytes; low and scale per channel over groups of `group` slots (groups, *shape) (a key
    entry), or per token, one a `rows` rows of d (L, ...), each slot's numbers contiguous -> (S, *shape)
    q s + m in dtype (fp32, or bf16 rounded once: the same numbers)."""
    assert packed.is_contiguous() and low.is_contiguous() and scale.is_contiguous()
    assert low.dtype == scale.dtype and dtype in (torch.float32, torch.bfloat16)
    slots = slots.to(torch.int64).contiguous()
    D = 2 * packed.size(-1)
    R = packed[0].numel() // packed.size(-1)
    out = torch.empty(len(slots), *packed.shape[1:-1], D, dtype=dtype)
    library().int4_gather(len(slots), R, D, packed.data_ptr(), low.data_ptr(), scale.data_ptr(),
                          int(low.dtype == torch.bfloat16), slots.data_ptr(), group or 1, rows,
                          int(group is not None), out.data_ptr(), int(dtype == torch.bfloat16))
    return out
