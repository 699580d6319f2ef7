"""
The machine a script runs on: which device (--device), what it computes in (the precision policy)
and its peak, for MFU. train.py, sample.py, bench.py and plan.py share these.
"""

from pathlib import Path

import torch

from configurator import ConfigError

PRECISION_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}

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


def native_dtype(device):
    """(dtype, why): bfloat16 where the device multiplies bf16 in hardware, float32 elsewhere.
    The dtype that training autocasts to, Muon's Newton-Schulz runs in and decoding holds its
    weights and KV cache in, unless a flag says otherwise. Where bf16 is emulated it is no saving:
    on an AVX2 CPU one 128M layer's training step takes 53x as long in bf16 as in fp32
    (docs/benchmarks.md#precision)."""
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.bfloat16, f"{torch.cuda.get_device_name(torch_device)} computes bf16"
        return torch.float32, f"{torch.cuda.get_device_name(torch_device)} has no bf16 tensor cores"
    if torch_device.type == "cpu":
        capability = torch.backends.cpu.get_cpu_capability()
        if cpu_has_bf16():
            return torch.bfloat16, f"this CPU ({capability}) has bf16 instructions"
        return torch.float32, f"this CPU ({capability}) has no bf16 matmul"
    return torch.float32, f"bf16 on {torch_device.type} is not known to be native"


def cpu_has_bf16():
    """Whether this CPU multiplies bf16 in hardware: x86's AVX512-BF16 or AMX-BF16 or Arm's BF16
    extension, as Linux lists them, and oneDNN, PyTorch's CPU matmul library, allowed to use them
    (ONEDNN_MAX_CPU_ISA=AVX2 makes such a CPU compute as an AVX2 one does)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # not Linux: no reliable way to tell, and fp32 is never emulated
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}) and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def peak_flops(device):
    """One device's dense bf16 peak, or None where MFU means nothing (a CPU, MPS, an unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)
