"""The house's rules, checked on the code itself: imports run one way (scripts use lib/, lib/ uses
model.py, model.py uses torch alone), with no circle anywhere and no module importing a script; a
checkpoint of any variant builds with nanoGPT's idiom, GPT(GPTConfig(**ckpt["model_args"])), and
decodes with its generate; and checkpoints of the code before the layers left model.py load as they
were."""

import ast
import math
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

import sample
import train
from lib.attention.decode import generate
from model import GPT, VARIANTS, GPTConfig
from references import TINY
from test_model import python_files
from test_train import data_dir, flags  # noqa: F401 (data_dir is a fixture)

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = {"prepare_data", "train", "analyze", "sample", "eval", "export_hf"}


def module_name(path):
    """The name a file is imported by: tests/ and the root are on the path (pytest.ini)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[0] == "tests":
        parts = parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph():
    """{module: the repository's modules it imports}, read from every file's import statements with
    ast, wherever they stand (a function's body included)."""
    modules = {module_name(path): path for path in python_files(REPO)}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        graph[name] = {module for module in found if module in modules and module != name}
    return graph


def cycle(graph):
    """A list of modules that import each other round in a circle, or None."""
    state = {}

    def visit(module, path):
        state[module] = "open"
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep, path + [dep])):
                return found
        state[module] = "done"
        return None
    return next((found for module in sorted(graph) if module not in state
                 and (found := visit(module, [module]))), None)


def test_imports_run_one_way_with_no_circle():
    graph = import_graph()
    assert cycle(graph) is None, " -> ".join(cycle(graph))
    assert graph["model"] == set()  # model.py imports torch alone
    for module, deps in graph.items():
        if module.startswith("lib"):
            assert not {dep for dep in deps if not dep.startswith("lib") and dep != "model"}, module
        if not module.startswith("test") and module not in ("conftest", "references"):
            assert not deps & SCRIPTS, f"{module} imports the script(s) {', '.join(deps & SCRIPTS)}"


def test_the_cycle_finder_finds_a_circle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_importing_model_loads_nothing_of_lib():
    code = "import sys, model; print(sorted(m for m in sys.modules if m == 'lib' or m.startswith('lib.')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_decoding_a_rival_needs_nothing_but_lib_attention_decode():
    """The steps are listed where decode.py reads them: no other import registers one first."""
    code = ("import torch; import lib.attention.decode as decode; from model import GPT, GPTConfig\n"
            "config = GPTConfig(attn='gla', vocab_size=64, block_size=16, n_layer=2, n_head=2, head_dim=16,"
            " n_embd=32, rope_head_dim=8, gla_latent_dim=32)\n"
            "model = GPT(config).double()\n"
            "assert decode.registered_step(model.blocks[0].attn) is not None\n"
            "torch.manual_seed(0); prompt = torch.randint(0, 64, (1, 4))\n"
            "fast = decode.generate(model, prompt, 10, temperature=0, step=decode.exact_step)\n"
            "assert torch.equal(fast, decode.generate(model, prompt, 10, temperature=0, use_cache=False))\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


@pytest.mark.parametrize("cla", [1, 2])
def test_a_checkpoint_of_any_variant_builds_with_nanogpts_idiom(cla, data_dir, tmp_path):
    """GPT(GPTConfig(**ckpt["model_args"])) with the checkpoint's weights gives the logits of the
    model that sample.py loads, for all nine variants."""
    idx = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    for attn in VARIANTS:
        out = tmp_path / f"{attn}-{cla}"
        shape = {f.name: getattr(TINY, f.name) for f in fields(TINY)
                 if f.name not in ("vocab_size", "attn") and getattr(TINY, f.name) is not None}
        assert train.main(flags(data_dir=data_dir, out_dir=out, **{**shape, "attn": attn, "cla": cla},
                                max_steps=1, warmup_steps=1, eval_tokens=64)) == 0
        ckpt = torch.load(out / "ckpt.pt", weights_only=True)
        model = GPT(GPTConfig(**ckpt["model_args"]))
        model.load_state_dict(ckpt["model"])
        _, sampled = sample.load_checkpoint(out / "ckpt.pt", "cpu")
        with torch.no_grad():
            assert torch.equal(model(idx)[0], sampled(idx)[0]), attn
        # nanoGPT's model.generate, its plain cache and loop, gives sample.py's greedy tokens (decode.py's
        # generate through the exact steps), past the context (block_size 32) too
        greedy = generate(sampled, idx, 40, temperature=0, vocab_size=256)
        assert torch.equal(model.generate(idx, 40, temperature=0), greedy), attn


VARIANTS_AT_6E79E41 = ("mha", "mqa", "gqa", "mla", "lrkv", "gta", "gla", "tpa", "mlra")


def test_checkpoints_of_the_code_before_the_layers_load_with_their_logits():
    """tests/fixtures/checkpoints-6e79e41.pt holds 27 tiny models written by commit 6e79e41's model.py, the
    last with sharing and windows inside it: the nine variants, each plain, with --cla=2 and windows,
    and with --yoco; their model_args, state_dict (names, shapes, float32 values) and float64 logits on
    fixed tokens (made there by building each with torch.manual_seed(i), then .double()). Today's
    GPT(GPTConfig(**model_args)) takes the state_dict key for key and gives the same logits."""
    record = torch.load(REPO / "tests" / "fixtures" / "checkpoints-6e79e41.pt", weights_only=True)
    # the record's variants, by name: those of that commit, all of which today's model still has
    assert {name.split("-")[0] for name in record["runs"]} == set(VARIANTS_AT_6E79E41) <= set(VARIANTS)
    assert {name.split("-", 1)[1] for name in record["runs"]} == {"plain", "cla2-window", "yoco"}
    for name, run in record["runs"].items():
        model = GPT(GPTConfig(**run["model_args"])).double().eval()
        sizes = [math.prod(shape) for _, shape in run["names"]]
        values = run["flat"].double().split(sizes)
        model.load_state_dict({key: v.view(shape) for (key, shape), v in zip(run["names"], values)})
        with torch.no_grad():
            torch.testing.assert_close(model(run["idx"])[0], run["logits"], rtol=0, atol=1e-12, msg=name)
