"""tools/install_torch.py without the network or nvidia-smi: the build it picks with a GPU, without one
and with nvidia-smi listing none; TORCH=cpu and cuda override it, any other value is a one-line error;
an unreachable CPU index falls back to PyPI's torch and says why, within the probe's timeout even
where the server never answers; a torch that satisfies requirements.txt is kept; the line comes
before pip runs, and make's install rule runs the script before requirements-dev.txt."""

import http.server
import socket
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

import pytest

from tools import install_torch
from tools.install_torch import CPU_INDEX, main, nvidia_gpus, plan, probe, torch_requirement

REPO = Path(__file__).resolve().parents[1]
REQ = "torch>=2.9"
CPU_ARGS = ["install", "-q", "--index-url", CPU_INDEX, REQ]
PYPI_ARGS = ["install", "-q", REQ]


def never(*args):
    raise AssertionError("asked although the pick did not need it")


def smi(stdout, returncode=0, stderr=""):
    """nvidia_gpus's probes for an nvidia-smi that prints stdout and exits with returncode."""
    def run(cmd, **kwargs):
        assert cmd == ["nvidia-smi", "-L"] and kwargs["timeout"]
        return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)
    return dict(which=lambda name: "/usr/bin/nvidia-smi", run=run)


H200 = "GPU 0: NVIDIA H200 (UUID: GPU-5d1c)\n"


@pytest.mark.parametrize("probes, expected", [
    (dict(which=lambda name: None, run=never), (0, "no nvidia-smi")),
    (smi(""), (0, "nvidia-smi lists 0 GPUs")),
    (smi("No devices were found\n", 6), (0, "nvidia-smi -L: No devices were found")),
    (smi("", 9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\nMore"),
     (0, "nvidia-smi -L: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")),
    (smi("", 1), (0, "nvidia-smi -L: exit 1")),
    (smi(H200), (1, "nvidia-smi lists 1 GPU")),
    (smi(H200 + "  MIG 1g.18gb     Device  0: (UUID: MIG-a1)\nGPU 1: NVIDIA H200 (UUID: GPU-77e0)\n"),
     (2, "nvidia-smi lists 2 GPUs")),
])
def test_nvidia_gpus(probes, expected):
    assert nvidia_gpus(**probes) == expected


def test_gpu_present_takes_pypi_cuda_without_probing():
    line, args = plan("auto", REQ, None, lambda: (1, "nvidia-smi lists 1 GPU"), never)
    assert args == PYPI_ARGS
    assert line == "torch: PyPI's CUDA build (nvidia-smi lists 1 GPU; TORCH=cpu for the CPU build)"


@pytest.mark.parametrize("why", ["no nvidia-smi", "nvidia-smi lists 0 GPUs"])
def test_no_gpu_takes_the_cpu_index(why):
    line, args = plan("auto", REQ, None, lambda: (0, why), lambda: None)
    assert args == CPU_ARGS
    assert line == f"torch: the CPU build from {CPU_INDEX} ({why}; TORCH=cuda for the CUDA build)"


def test_override_cpu_ignores_the_gpu():
    line, args = plan("cpu", REQ, None, never, lambda: None)
    assert args == CPU_ARGS and "(TORCH=cpu;" in line


def test_override_cuda_asks_nothing():
    assert plan("cuda", REQ, None, never, never) == ("torch: PyPI's CUDA build (TORCH=cuda)", PYPI_ARGS)


def test_unreachable_cpu_index_falls_back_to_pypi_and_says_why():
    line, args = plan("auto", REQ, None, lambda: (0, "no nvidia-smi"), lambda: "URLError: timed out, 3.0 s")
    assert args == PYPI_ARGS
    assert line == (f"torch: PyPI's default build, CUDA on Linux (no nvidia-smi, but {CPU_INDEX} "
                    "is out of reach: URLError: timed out, 3.0 s)")


def test_explicit_cpu_with_the_index_out_of_reach_is_an_error():
    with pytest.raises(ValueError, match=r"^TORCH=cpu, but .* out of reach \(no answer in 3.0 s\)"):
        plan("cpu", REQ, None, never, lambda: "no answer in 3.0 s")


@pytest.mark.parametrize("build", ["auto", "cpu", "cuda"])
def test_a_satisfying_torch_is_kept_without_probing(build):
    line, args = plan(build, REQ, "2.13.0+cpu", never, never)
    assert args is None and line.startswith("torch: 2.13.0+cpu in the venv satisfies torch>=2.9, kept")


@pytest.mark.parametrize("argv, code, message", [
    (["gpu"], 1, "install_torch: TORCH=gpu is none of auto, cpu, cuda\n"),
    (["cpu", "cuda"], 2, "usage: install_torch.py [auto|cpu|cuda]\n"),
])
def test_bad_arguments_are_one_line_and_install_nothing(monkeypatch, capsys, argv, code, message):
    monkeypatch.setattr(install_torch.subprocess, "run", never)
    assert main(argv) == code
    assert capsys.readouterr() == ("", message)


def test_explicit_cpu_out_of_reach_exits_1_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(install_torch, "installed_torch", lambda requirement: None)
    monkeypatch.setattr(install_torch, "probe", lambda: "no answer in 3.0 s")
    monkeypatch.setattr(install_torch.subprocess, "run", never)
    assert main(["cpu"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("install_torch: TORCH=cpu, but")


@pytest.mark.parametrize("unreachable, pip_args", [(None, CPU_ARGS), ("no answer in 3.0 s", PYPI_ARGS)])
def test_main_prints_the_pick_then_runs_pip(monkeypatch, capsys, unreachable, pip_args):
    calls = []

    def run(cmd, **kwargs):
        calls.append((cmd, capsys.readouterr().out))  # what was printed before pip ran
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(install_torch, "installed_torch", lambda requirement: None)
    monkeypatch.setattr(install_torch, "nvidia_gpus", lambda: (0, "no nvidia-smi"))
    monkeypatch.setattr(install_torch, "probe", lambda: unreachable)
    monkeypatch.setattr(install_torch.subprocess, "run", run)
    assert main([]) == 0
    [(cmd, printed)] = calls
    assert cmd == [sys.executable, "-m", "pip", *pip_args]
    assert printed.startswith("torch: ") and printed.count("\n") == 1
    assert ("out of reach: no answer in 3.0 s" in printed) == (unreachable is not None)


def test_main_passes_pips_failure_on(monkeypatch):
    monkeypatch.setattr(install_torch, "installed_torch", lambda requirement: None)
    def failing(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 3)

    monkeypatch.setattr(install_torch.subprocess, "run", failing)
    assert main(["cuda"]) == 3


def test_torch_requirement_is_requirements_txts_line(tmp_path):
    assert torch_requirement() == REQ  # the requirement's version lives in requirements.txt alone
    path = tmp_path / "requirements.txt"
    path.write_text("torchvision>=0.2\ntorch-audio\n  torch >= 2.9, < 3  # the model\nnumpy\n")
    assert torch_requirement(path) == "torch >= 2.9, < 3"
    path.write_text("torchvision\nnumpy\n")
    with pytest.raises(ValueError, match="names no torch"):
        torch_requirement(path)


def test_installed_torch_checks_the_requirement():
    version = metadata.version("torch")  # the tests' own venv has one
    assert install_torch.installed_torch("torch>=2.9") == version
    assert install_torch.installed_torch("torch>=99") is None
    assert install_torch.installed_torch(f"torch!={version}") is None


@pytest.fixture
def server():
    """A local HTTP server that answers 200 to GET /ok and 404 to any other path."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/ok" else 404)
            self.end_headers()
            self.wfile.write(b"<html>" + b"x" * 100_000)  # an index page the probe need not read

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_probe_answers_none_where_the_index_answers(server):
    assert probe(server + "/ok", timeout=5) is None
    assert probe(server + "/missing", timeout=5).startswith("HTTPError: Not Found, ")


def test_probe_is_bounded_where_the_server_never_answers():
    with socket.socket() as blackhole:  # accepts connections (the backlog) and never answers
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(8)
        start = time.monotonic()
        reason = probe(f"http://127.0.0.1:{blackhole.getsockname()[1]}/", timeout=0.5)
        waited = time.monotonic() - start
    assert reason is not None and 0.4 < waited < 2, (reason, waited)


def test_probe_is_bounded_where_the_name_lookup_hangs():
    release = threading.Event()
    threading.Timer(3, release.set).start()  # a probe that waited for the lookup fails, not hangs

    def opener(request, timeout):  # a lookup that ignores the socket's timeout
        release.wait()
        raise OSError("released")

    start = time.monotonic()
    assert probe("https://example.invalid/", timeout=0.3, opener=opener) == "no answer in 0.3 s"
    assert time.monotonic() - start < 1


def test_makes_install_rule_picks_torch_before_the_rest():
    commands = subprocess.run(["make", "-n", "-B", ".venv/installed", "TORCH=cpu"], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout.splitlines()
    picks = [i for i, c in enumerate(commands) if c == ".venv/bin/python tools/install_torch.py cpu"]
    rest = [i for i, c in enumerate(commands) if "pip install -q -r requirements-dev.txt" in c]
    assert len(picks) == 1 and len(rest) == 1 and picks[0] < rest[0], commands
