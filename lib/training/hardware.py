"""
The machine a script runs on: which device (--device), what it computes in (the precision policy)
and its peak, for MFU. train.py, sample.py, bench.py and plan.py share these.
"""

import os
from pathlib import Path

import torch

from lib.training.configurator import ConfigError

PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}

# What the precision policy decides, one dtype each: train.py's autocast, Muon's Newton-Schulz, and
# the weights and KV cache that sample.py, eval.py and train.py's in-loop tasks decode with
USES = ("train", "newton_schulz", "decode")
USE_NAMES = dict(train="training", newton_schulz="Newton-Schulz", decode="decoding")
# LRKV_PRECISION=bf16 or fp32 forces every use to it, on any device: a user's override for a whole run
FORCE = "LRKV_PRECISION"
FORCED = {"bf16": torch.bfloat16, "fp32": torch.float32}

# The policy on a CPU, by its class: what multiplies bf16 there (cpu_class). Each use runs in whichever
# of bf16 and fp32 a CPU of that class ran faster (docs/benchmarks.md#precision, which has the numbers
# and the commands). Training autocasts and Newton-Schulz multiplies whole matrices, which a bf16 unit
# does in about half of fp32's time; where bf16 is emulated it takes dozens of times fp32's. Decoding
# a token reads the whole cache through matrix-vector products and small GEMMs, whose bf16 kernels
# lost to fp32's on both classes with a bf16 unit, but for different variants (MHA on one, LRKV and MLA
# on the other): fp32, which wins as often, also decodes the same tokens on every CPU.
BF16, FP32 = torch.bfloat16, torch.float32
CPU_POLICY = {
    "AMX": dict(train=BF16, newton_schulz=BF16, decode=FP32),
    "AVX512-BF16": dict(train=BF16, newton_schulz=BF16, decode=FP32),
    "AVX2": dict(train=FP32, newton_schulz=FP32, decode=FP32),  # bf16 emulated, in fp32
}
# LRKV_CPU_CLASS=AVX2, AVX512-BF16 or AMX: the policy decides as a CPU of that class would, on any CPU
# (where this one has no bf16 unit, bf16 still computes, emulated and slower). make test runs the suite
# once under each distinct policy (policy_classes) this way, so that a test holding on one class only
# fails on every machine.
CLASS = "LRKV_CPU_CLASS"


def policy_classes():
    """One CPU class for each distinct policy of CPU_POLICY, the first that has it: what make test
    runs the suite under."""
    first = {}
    for name, policy in CPU_POLICY.items():
        first.setdefault(tuple(policy.items()), name)
    return list(first.values())


# Dense bf16 peak FLOP/s of one GPU, matched in this order against torch.cuda.get_device_name
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


# What --device takes, in every script. No index: under torchrun the local rank picks the GPU,
# and CUDA_VISIBLE_DEVICES picks one for a single process.
DEVICES = ("auto", "cuda", "mps", "cpu")


def check_device(name):
    """name if it is one of DEVICES, else a ConfigError of one line that lists them."""
    if name not in DEVICES:
        raise ConfigError(f"--device={name}: not a device; valid: {', '.join(DEVICES)} "
                          "(CUDA_VISIBLE_DEVICES picks the GPU)")
    return name


def pick_device(name, local_rank=0):
    """The torch.device that --device names ("auto": cuda, then mps, then cpu), or a ConfigError
    that lists the devices this machine has."""
    available = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(), "cpu": True}
    if check_device(name) == "auto":
        name = next(device for device, present in available.items() if present)
    if not available[name]:
        here = ", ".join(["auto", *(device for device, present in available.items() if present)])
        raise ConfigError(f"--device={name}: not available on this machine; valid here: {here}")
    return torch.device("cuda", local_rank) if name == "cuda" else torch.device(name)


def precision(use, device):
    """(dtype, why) for one of USES on device: bf16 or fp32, by the policy (CPU_POLICY on a CPU, for
    cpu_class's class; bf16 on a GPU with bf16 tensor cores; fp32 elsewhere, MPS included), unless
    LRKV_PRECISION forces one. why is the reason, for the line each script prints first."""
    if use not in USES:
        raise ValueError(f"precision use {use!r}: one of {', '.join(USES)}")
    forced = check_environment()
    if forced is not None:
        return forced, f"{FORCE}={os.environ[FORCE]}"
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        name = torch.cuda.get_device_name(torch_device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.bfloat16, f"{name} computes bf16"
        return torch.float32, f"{name} has no bf16 tensor cores"
    if torch_device.type == "cpu":
        name, here = cpu_class()
        dtype = CPU_POLICY[name][use]
        if name == "AVX2":
            return dtype, f"{here} would emulate bf16"
        return dtype, f"{here}: its class ran {USE_NAMES[use]} faster in {PRECISION_NAMES[dtype]}"
    return torch.float32, f"bf16 on {torch_device.type} is not known to be native"


def decoding_dtype(run_dtype, device):
    """(dtype, why): what a trained model decodes and scores in, the same in sample.py, eval.py and
    train.py's in-loop tasks (so that a task's value logged at an evaluation is eval.py's on the
    checkpoint saved there): LRKV_PRECISION's where it is set (it forces every script), else the
    precision policy's for decoding, but float32 for a run whose --dtype (run_dtype, its config's) is
    float32 by choice, whose logits are then training's own."""
    forced = check_environment()
    if forced is not None:
        return forced, f"{FORCE}={os.environ[FORCE]}"
    if run_dtype == "float32":
        return torch.float32, "the run trained in float32 by choice"
    return precision("decode", device)


def check_environment():
    """The dtype that LRKV_PRECISION forces (None where it is unset or empty), after checking both
    variables: a ConfigError of one line for a value of either that is not theirs. A script calls it
    before it writes anything."""
    chosen = os.environ.get(CLASS)
    if chosen and chosen not in CPU_POLICY:
        raise ConfigError(f"{CLASS}={chosen}: must be one of {', '.join(CPU_POLICY)}, "
                          "or unset for this CPU's own")
    forced = os.environ.get(FORCE)
    if forced and forced not in FORCED:
        raise ConfigError(f"{FORCE}={forced}: must be one of {', '.join(FORCED)}, or unset for the policy")
    return FORCED[forced] if forced else None


def cpu_class():
    """(class, where from): the CPU class, a key of CPU_POLICY, that the policy decides for:
    LRKV_CPU_CLASS's where it is set, else this CPU's own (detected_cpu_class)."""
    chosen = os.environ.get(CLASS)
    if chosen:
        check_environment()
        return chosen, f"{CLASS}={chosen}"
    name = detected_cpu_class()
    return name, f"this CPU ({torch.backends.cpu.get_cpu_capability()}, {name})"


def detected_cpu_class():
    """What multiplies bf16 on this CPU, for oneDNN (PyTorch's CPU matmul library): "AMX" (Intel's
    tile unit, AMX-BF16), "AVX512-BF16" (bf16 dot products in the vector unit: AVX512-BF16, or Arm's
    BF16 extension), or "AVX2" (nothing: bf16 emulated in fp32, whatever the vector unit). Linux's
    flags say what the CPU has, and ONEDNN_MAX_CPU_ISA what oneDNN may use of it:
    ONEDNN_MAX_CPU_ISA=AVX2 makes any CPU an AVX2 one, AVX512_CORE_BF16 an AMX CPU one without AMX."""
    if not onednn_has_bf16():
        return "AVX2"
    flags = cpu_flags()
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    uncapped = cap in ("ALL", "DEFAULT")
    if "amx_bf16" in flags and (uncapped or "AMX" in cap):
        return "AMX"
    # oneDNN's ISAs from AVX512_CORE_BF16 up all have bf16 dot products
    if flags & {"avx512_bf16", "bf16"} and (uncapped or "BF16" in cap or "FP16" in cap or "AMX" in cap
                                            or cap.startswith("AVX10")):
        return "AVX512-BF16"
    return "AVX2"


def cpu_flags():
    """The CPU's feature flags as Linux lists them; none off Linux, where no reliable way tells, and
    fp32 is never emulated."""
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def onednn_has_bf16():
    """Whether this build of oneDNN computes bf16 on this CPU at all (False under ONEDNN_MAX_CPU_ISA=AVX2)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def peak_flops(device):
    """One device's dense bf16 peak, or None where MFU means nothing (a CPU, MPS, an unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)
