"""The precision policy (hardware.precision) and the scripts under it. The policy's tests set the CPU
class (LRKV_CPU_CLASS) instead of reading it, so that they pass on every machine; the scripts' test
runs under whatever policy make test's pass is of (it runs the suite once per distinct policy,
bf16 emulated where the machine has no bf16 unit), and asks each script for that policy's dtype:
train.py trains, resumes exactly and converts at the checkpoint's loss, sample.py's greedy sample
is generate()'s, analyze.py draws the run and bench.py measures it, each saying the precision in its
first line. Emulated bf16 is slow, so the model is tiny."""

import json
import re

import pytest
import torch

import analyze
import eval as eval_script
import export_hf
from tools import bench, quant_frontier

from lib.training import configurator

from lib.training import hardware

from lib.training import muon

import sample
import train
from lib.training.checkpoint import load_checkpoint
from test_sample import SEPARATOR, reference
from test_train import data_dir, flags, records  # noqa: F401 (data_dir is a fixture)

@pytest.mark.parametrize("name", hardware.CPU_POLICY)
def test_the_policy_gives_each_use_its_classs_choice_and_fp32_where_bf16_is_emulated(name, monkeypatch):
    """Machine-independent: the CPU class is set, not read."""
    monkeypatch.delenv(hardware.FORCE, raising=False)
    monkeypatch.setenv(hardware.CLASS, name)
    for use in hardware.USES:
        dtype, why = hardware.precision(use, "cpu")
        assert dtype == hardware.CPU_POLICY[name][use] and why.startswith(f"LRKV_CPU_CLASS={name}")
    muon_ns = muon.Muon([torch.nn.Parameter(torch.ones(2, 2))]).ns_dtype
    assert muon_ns == hardware.CPU_POLICY[name]["newton_schulz"]
    if name == "AVX2":  # bf16 emulated: no use may take it
        assert set(hardware.CPU_POLICY[name].values()) == {torch.float32}
    assert hardware.precision("train", "meta")[0] == torch.float32


def test_without_the_class_set_the_policy_reads_this_cpus(monkeypatch):
    monkeypatch.delenv(hardware.FORCE, raising=False)
    monkeypatch.delenv(hardware.CLASS, raising=False)
    monkeypatch.setattr(hardware, "detected_cpu_class", lambda: "AMX")
    assert hardware.cpu_class() == ("AMX", f"this CPU ({torch.backends.cpu.get_cpu_capability()}, AMX)")
    assert hardware.precision("train", "cpu")[0] == torch.bfloat16


def test_make_test_runs_one_pass_per_distinct_policy():
    classes = hardware.policy_classes()
    assert len({tuple(hardware.CPU_POLICY[name].items()) for name in classes}) == len(classes)
    assert {tuple(p.items()) for p in hardware.CPU_POLICY.values()} == {
        tuple(hardware.CPU_POLICY[name].items()) for name in classes}


def test_lrkv_precision_forces_every_use_and_anything_else_is_one_line(monkeypatch):
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        monkeypatch.setenv(hardware.FORCE, name)
        for use in hardware.USES:
            assert hardware.precision(use, "cpu") == (dtype, f"LRKV_PRECISION={name}")
    monkeypatch.setenv(hardware.FORCE, "float16")
    with pytest.raises(configurator.ConfigError, match="^LRKV_PRECISION=float16: must be one of bf16, fp32"):
        hardware.precision("train", "cpu")
    monkeypatch.delenv(hardware.FORCE)
    monkeypatch.setenv(hardware.CLASS, "avx512")
    with pytest.raises(configurator.ConfigError,
                       match="^LRKV_CPU_CLASS=avx512: must be one of AMX, AVX512-BF16, AVX2, or unset"):
        hardware.precision("decode", "cpu")


# Every script checks the environment the same way (hardware.check_environment), first: a value of
# either variable that is not theirs is refused in one line naming it, before anything is read or
# written, whatever else the command line holds; analyze.py's bad input exits 1, the others' 2.
SCRIPTS = {"train.py": (train.main, lambda tmp: [f"--out_dir={tmp / 'out'}", "--device=cpu"], 2),
           "sample.py": (sample.main, lambda tmp: [str(tmp / "ckpt.pt"), "--device=cpu"], 2),
           "eval.py": (eval_script.main, lambda tmp: [str(tmp / "ckpt.pt"), "--device=cpu"], 2),
           "analyze.py": (analyze.main, lambda tmp: [str(tmp / "ckpt.pt"), f"--out_dir={tmp / 'out'}"], 1),
           "export_hf.py": (export_hf.main, lambda tmp: [str(tmp / "ckpt.pt"), str(tmp / "out")], 2),
           "tools/quant_frontier.py": (quant_frontier.main,
                                       lambda tmp: [str(tmp / "ckpt.pt"), f"--out_dir={tmp / 'out'}"], 2)}


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("variable, value", [("LRKV_CPU_CLASS", "garbage"), ("LRKV_CPU_CLASS", "avx2"),
                                             ("LRKV_PRECISION", "fp16")])
def test_every_script_refuses_a_bad_environment_in_one_line(script, variable, value, tmp_path,
                                                            monkeypatch, capsys):
    main, argv, expected = SCRIPTS[script]
    monkeypatch.setenv(variable, value)
    try:
        code = main(argv(tmp_path))
    except SystemExit as e:  # analyze.py: sys.exit(message)
        code, message = 1, str(e.code)
    else:
        message = capsys.readouterr().err.removeprefix(f"{script}: ").rstrip("\n")
    assert code == expected
    assert message.startswith(f"{variable}={value}: must be one of") and "\n" not in message, message
    assert capsys.readouterr().out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flags, cap, unit", [
    ({"avx2"}, "", "AVX2"),
    ({"avx512_bf16", "amx_bf16"}, "", "AMX"),
    ({"avx512_bf16", "amx_bf16"}, "AVX512_CORE_BF16", "AVX512-BF16"),
    ({"avx512_bf16", "amx_bf16"}, "avx512_core_amx", "AMX"),
    ({"avx512_bf16"}, "", "AVX512-BF16"),
    ({"avx512_bf16"}, "AVX512_CORE", "AVX2"),
    ({"avx512_bf16", "amx_bf16"}, "AVX2", "AVX2"),
    ({"bf16"}, "", "AVX512-BF16"),  # Arm's BF16 extension
])
def test_the_cpu_class_is_what_the_cpu_has_and_onednn_may_use(flags, cap, unit, monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    monkeypatch.setattr(hardware, "onednn_has_bf16", lambda: True)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert hardware.detected_cpu_class() == unit
    monkeypatch.setattr(hardware, "onednn_has_bf16", lambda: False)  # a oneDNN built without bf16
    assert hardware.detected_cpu_class() == "AVX2"


# the precision line each script prints first, for a forced precision
TRAIN_LINE = {
    "bf16": "precision: bf16 autocast (LRKV_PRECISION=bf16), Newton-Schulz in bf16 (LRKV_PRECISION=bf16)",
    "fp32": "precision: fp32 (LRKV_PRECISION=fp32), Newton-Schulz in fp32 (LRKV_PRECISION=fp32)",
}


# bf16 forced: every use in bf16, decoding included, which no CPU class's policy gives (a GPU's
# does). fp32 throughout is the AVX2 pass's own policy, which every other test runs under.
@pytest.mark.parametrize("forced", ["bf16"])
def test_the_scripts_train_resume_convert_sample_analyze_and_bench_in_a_forced_precision(
        forced, data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(hardware.FORCE, forced)
    dtype = hardware.FORCED[forced]
    tiny = dict(data_dir=data_dir, max_steps=4, eval_interval=2, attn="mha")
    full, split = tmp_path / "full", tmp_path / "split"
    assert train.main(flags(out_dir=full, **tiny)) == 0
    assert capsys.readouterr().out.splitlines()[0] == TRAIN_LINE[forced]
    assert train.main(flags(out_dir=split, stop_after=2, **tiny)) == 0
    assert train.main(flags(out_dir=split, **tiny) + ["--resume"]) == 0
    assert records(split, "loss") == records(full, "loss")  # in bf16 as in fp32: the same operations

    # at step 0 an identity conversion is the checkpoint's loss exactly, and a full-rank LRKV (the
    # same heads, W_shared + U_h B_h^T) the same up to rounding in the eval's dtype: the two compute
    # each key through different matmuls, whose roundings in bf16 differ by up to ~2^-8 of each logit
    expected = torch.load(full / "ckpt.pt", weights_only=True)["val_loss"]
    lrkv_tol = 5e-2 if dtype == torch.bfloat16 else 1e-5
    for name, attn, tol in (("same", dict(attn="mha"), 0.0),
                            ("lrkv", dict(attn="lrkv", lrkv_rank=16), lrkv_tol)):
        out = tmp_path / name
        assert train.main(flags(**{**tiny, **attn, "max_steps": 1, "eval_interval": 1}, out_dir=out,
                                init_from=full / "ckpt.pt", calibration_tokens=0)) == 0
        val = records(out, "val_loss")[0]
        assert abs(val - expected) <= tol, (name, val, expected)
    capsys.readouterr()

    ckpt_path = full / "ckpt.pt"
    assert sample.main([str(ckpt_path), "--device=cpu", "--prompt=def ", "--temperature=0",
                        "--max_new_tokens=12"]) == 0
    first, text = capsys.readouterr().out.split("\n", 1)
    name = str(dtype).removeprefix("torch.")
    assert first.startswith(f"precision: {name} weights (LRKV_PRECISION={forced}) | KV cache "), first
    assert f"({name}, 1 x " in first, first
    model = load_checkpoint(ckpt_path, "cpu")[1].to(dtype).eval()
    for cache in (True, False):  # the cached and the uncached decoding agree in bf16 too
        assert text.split(SEPARATOR)[0] == reference(model, "def ", 12, temperature=0, use_cache=cache)[0]

    analyze.main([str(ckpt_path), f"--out_dir={tmp_path / 'figures'}"])
    assert json.loads((tmp_path / "figures" / "analysis.json").read_text())["runs"][0]["attn"] == "mha"

    bench_out = tmp_path / "bench.json"
    bench.main(["--preset=tiny", "--device=cpu", "--attn=mha,lrkv", "--no-compiled_decode",
                f"--out={bench_out}"])
    result = json.loads(bench_out.read_text())
    assert result["decode"]["dtype"] == str(dtype).removeprefix("torch.")
    assert result["train"]["ns_dtype"] == forced
    assert re.search(rf"precision: train {forced} \(LRKV_PRECISION={forced}\)", capsys.readouterr().out)


@pytest.fixture(scope="module")
def whole_checkpoint(data_dir, tmp_path_factory):
    """The bytes of the ckpt.pt and log.jsonl that train.py writes for a tiny run of one step."""
    out = tmp_path_factory.mktemp("whole")
    assert train.main(flags(data_dir=data_dir, out_dir=out, max_steps=1, eval_interval=1)) == 0
    return (out / "ckpt.pt").read_bytes(), (out / "log.jsonl").read_bytes()


# A checkpoint cut short (a save killed in a file system that renames late, a copy cut off) is the
# one line of load_checkpoint, which every script reads checkpoints through: the path, "truncated",
# what to do; each script's exit code for bad input (SCRIPTS'), and nothing written, train.py
# --resume's folder as it was. Cut at 20 KB, inside the first tensors, and at half, past them.
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("cut", [20_000, "half"])
def test_every_script_refuses_a_checkpoint_cut_short_in_one_line(script, cut, whole_checkpoint, data_dir,
                                                                 tmp_path, capsys):
    main, argv, expected = SCRIPTS[script]
    whole, log = whole_checkpoint
    cut_bytes = whole[:len(whole) // 2 if cut == "half" else cut]
    assert 20_000 < len(whole) // 2
    ckpt_path = tmp_path / "ckpt.pt"
    ckpt_path.write_bytes(cut_bytes)
    (tmp_path / "log.jsonl").write_bytes(log)
    args = {"train.py": flags(data_dir=data_dir, out_dir=tmp_path) + ["--resume"],
            "eval.py": argv(tmp_path) + ["--tasks=humaneval", "--limit=1"]}.get(script, argv(tmp_path))
    try:
        code = main(args)
    except SystemExit as e:  # analyze.py: sys.exit(message)
        code, message = 1, str(e.code)
    else:
        message = capsys.readouterr().err.removeprefix(f"{script}: ").rstrip("\n")
    assert code == expected
    assert message == (f"{ckpt_path}: truncated after {len(cut_bytes):,} bytes: a checkpoint's start without "
                       "its end (a save or a copy cut short); restore it from a whole copy or train it again")
    assert capsys.readouterr().out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "log.jsonl"]
    assert ckpt_path.read_bytes() == cut_bytes and (tmp_path / "log.jsonl").read_bytes() == log
