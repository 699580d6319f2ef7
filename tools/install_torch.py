"""
Install torch into the virtual environment that runs this script, the build for the machine: PyTorch's
CPU wheels where no NVIDIA GPU is, PyPI's default torch (on Linux the CUDA build, ~4.5 GB more) where
one is. make's install rule runs it before requirements-dev.txt, which then finds torch satisfied.

    .venv/bin/python tools/install_torch.py [auto|cpu|cuda]      # make demo TORCH=cpu (or cuda)

auto (the default): cuda where `nvidia-smi -L` lists a GPU, else cpu. cpu takes torch from the CPU
index alone, as PyTorch's install page does (its dependencies are mirrored there); where that index
does not answer within PROBE_TIMEOUT seconds (a machine that reaches PyPI alone), auto takes PyPI's
torch and says so, and an explicit cpu is a one-line error. A torch in the venv that satisfies
requirements.txt is kept, whatever its build, and nothing is probed or downloaded. One line, printed
before anything downloads, says the pick and why; errors are one line and exit code 1 (2 for usage).
"""

import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from importlib import metadata
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT = 3.0  # seconds for the CPU index to answer, name lookup included
BUILDS = ("auto", "cpu", "cuda")
REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements.txt"


def torch_requirement(path=REQUIREMENTS):
    """requirements.txt's torch line, e.g. 'torch>=2.9', so that the version lives in one place."""
    for line in Path(path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if re.match(r"torch(?![-_.\w])", line):
            return line
    raise ValueError(f"{path} names no torch")


def installed_torch(requirement):
    """The version of the torch installed here if it satisfies requirement, else None."""
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare venv has packaging only inside pip
        from pip._vendor.packaging.requirements import Requirement
    return version if Requirement(requirement).specifier.contains(version, prereleases=True) else None


def nvidia_gpus(which=shutil.which, run=subprocess.run):
    """(GPUs that `nvidia-smi -L` lists, why): 0 where nvidia-smi is missing, fails or lists none."""
    if which("nvidia-smi") is None:
        return 0, "no nvidia-smi"
    try:
        listing = run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as error:
        return 0, f"nvidia-smi -L: {type(error).__name__}"
    if listing.returncode != 0:  # no driver, or (exit 6) "No devices were found"
        first = (listing.stdout + listing.stderr).strip().splitlines()
        return 0, f"nvidia-smi -L: {first[0] if first else f'exit {listing.returncode}'}"
    gpus = sum(line.startswith("GPU ") for line in listing.stdout.splitlines())
    return gpus, f"nvidia-smi lists {gpus} GPU{'s' if gpus != 1 else ''}"


def probe(url=f"{CPU_INDEX}/torch/", timeout=PROBE_TIMEOUT, opener=urllib.request.urlopen):
    """None where url (the page pip reads first) answers 200 within timeout seconds, else why not; the
    body is not read. The request runs in a daemon thread that is abandoned at the deadline: a
    socket timeout does not bound a name lookup."""
    outcome = []

    def ask():
        try:
            with opener(url, timeout=timeout) as response:
                outcome.append(None if response.status == 200 else f"HTTP {response.status}")
        except Exception as error:  # any failure is a reason to fall back, and is reported
            reason = getattr(error, "reason", None) or error
            outcome.append(f"{type(error).__name__}: {reason}" if str(reason) else type(error).__name__)

    start = time.monotonic()
    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout)
    waited = time.monotonic() - start
    if not outcome:
        return f"no answer in {waited:.1f} s"
    return outcome[0] and f"{outcome[0]}, {waited:.1f} s"


def plan(build, requirement, kept, gpus, reach):
    """(the line to print, pip's arguments or None): what to install for build (auto, cpu, cuda).
    kept: the installed torch's version where it satisfies requirement, else None. gpus() and
    reach() are asked only where the pick needs them: gpus() -> (count, why), nvidia_gpus's answer;
    reach() -> None where the CPU index answers, else why not, probe's answer. ValueError: a build
    that is none of BUILDS, or cpu asked for and its index out of reach."""
    if build not in BUILDS:
        raise ValueError(f"TORCH={build} is none of {', '.join(BUILDS)}")
    if kept is not None:
        return (f"torch: {kept} in the venv satisfies {requirement}, kept "
                "(another build: rm -r .venv, then make TORCH=cpu or cuda)", None)
    cpu = ["install", "-q", "--index-url", CPU_INDEX, requirement]
    pypi = ["install", "-q", requirement]
    if build == "cuda":
        return "torch: PyPI's CUDA build (TORCH=cuda)", pypi
    if build == "auto":
        count, why = gpus()
        if count:
            return f"torch: PyPI's CUDA build ({why}; TORCH=cpu for the CPU build)", pypi
    else:
        why = "TORCH=cpu"
    unreachable = reach()
    if unreachable is None:
        return f"torch: the CPU build from {CPU_INDEX} ({why}; TORCH=cuda for the CUDA build)", cpu
    if build == "cpu":
        raise ValueError(f"TORCH=cpu, but {CPU_INDEX} is out of reach ({unreachable}); "
                         "without TORCH, make takes PyPI's torch")
    return (f"torch: PyPI's default build, CUDA on Linux ({why}, but {CPU_INDEX} "
            f"is out of reach: {unreachable})", pypi)


def main(argv):
    if len(argv) > 1:
        print(f"usage: install_torch.py [{'|'.join(BUILDS)}]", file=sys.stderr)
        return 2
    try:
        requirement = torch_requirement()
        build = argv[0] if argv else "auto"
        line, pip_args = plan(build, requirement, installed_torch(requirement), nvidia_gpus, probe)
    except ValueError as error:
        print(f"install_torch: {error}", file=sys.stderr)
        return 1
    print(line, flush=True)
    if pip_args is None:
        return 0
    return subprocess.run([sys.executable, "-m", "pip", *pip_args]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
