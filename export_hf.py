"""
Export a train.py checkpoint to a folder that Hugging Face transformers and lm-evaluation-harness
load, offline, with its tokenizer:

    python export_hf.py out/demo/lrkv/ckpt.pt out/hf/lrkv
    python export_hf.py out/demo/mha/ckpt.pt out/hf/mha                   # native NanoChat
    python export_hf.py out/demo/mha/ckpt.pt out/hf/mha-code --remote_code
    python export_hf.py out/demo/lrkv/ckpt.pt out/hf/lrkv-native --native

A folder runs this repository's own model code: the export copies model.py and the files of
lib/attention/ that the model runs (ring.py, layout.py, rivals.py, the file of a variant of your own)
beside hf/modeling_lrkv.py, the thin layer transformers asks for, their imports made relative; so a
variant added to model.VARIANTS exports as it is, and a variant whose file imports what a folder cannot
hold is refused in one line. AutoModelForCausalLM (and AutoModel) .from_pretrained(folder,
trust_remote_code=True) loads it. MHA, GQA and MQA with no shared keys or window become transformers'
own NanoChatForCausalLM instead (no remote code), unless --remote_code; --native turns LRKV into
NanoChatForCausalLM too, each head's key and value weights materialised as W_shared + U_h B_h^T: same
outputs, MHA's cache.

The folder holds config.json, model.safetensors, generation_config.json, the tokenizer, a README.md
model card and the LICENSE, and the model code where it has remote code. It is built in a temporary
folder beside OUT_DIR and renamed at the end: a failed export leaves nothing, and one killed midway
leaves a hidden .OUT_DIR.* folder, which the next export to OUT_DIR removes and says so. Bad input (a
checkpoint that does not load or has no tokenizer this export knows, an OUT_DIR that is not an empty
folder, --native for a variant it cannot express, a full disk or a folder it cannot write) is one line
on stderr and exit code 2; Ctrl-C one line and exit code 130. docs/export.md says more.
"""

import ast
import base64
import dataclasses
import hashlib
import inspect
import json
import os
import re
import secrets
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

# This repository's code, all of it that the export reads
from lib.attention.heads import head_kv_weights
from lib.attention.layout import kv_source, layer_window
from lib.training.checkpoint import load_checkpoint
from lib.training.configurator import ArgumentParser, ConfigError, interruption, run_main
from lib.training.data import load_tokenizer
from lib.training.hardware import check_environment
from model import attention_class

REPO = Path(__file__).resolve().parent
MODELING = REPO / "hf" / "modeling_lrkv.py"  # what transformers asks for, in every remote-code folder
ALWAYS = [REPO / "model.py", REPO / "lib" / "attention" / "ring.py", REPO / "lib" / "attention" / "layout.py"]
GPT2_RANKS = REPO / "gpt2.tiktoken"  # GPT-2's BPE, tiktoken's ranks: a token's id is its rank
EOT = "<|endoftext|>"
NATIVE = ("mha", "gqa", "mqa")  # NanoChatForCausalLM's attention: G key/value heads of d_h
NATIVE_IF_ASKED = ("lrkv",)  # --native: LRKV's heads materialised into MHA's


def transformers_requirement():
    """requirements-hf.txt's transformers line, e.g. 'transformers>=5.0,<6': the versions a folder needs."""
    for line in (REPO / "requirements-hf.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if re.match(r"transformers(?![-_.\w])", line):
            return line
    raise ValueError("requirements-hf.txt names no transformers")


def main(argv=None):
    """Export; the exit code: 0 done, 2 bad input, 130 interrupted (Ctrl-C; SIGTERM, SIGHUP: 128 + the
    signal), nothing left behind."""
    try:
        return export_checkpoint(argv)
    except KeyboardInterrupt as e:  # write_atomically has removed what it wrote
        said, code = interruption(e)
        print(f"export_hf.py: {said}; nothing was written", file=sys.stderr)
        return code


def export_checkpoint(argv):
    """main's work: the exit code, 0 done, 2 bad input."""
    parser = ArgumentParser(prog="export_hf.py", description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("ckpt", help="a ckpt.pt written by train.py")
    parser.add_argument("out_dir", help="the folder to write: it must not exist, or be empty")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--native", action="store_true",
                      help="LRKV as transformers' NanoChatForCausalLM, its heads materialised (MHA's cache)")
    kind.add_argument("--remote_code", action="store_true",
                      help="MHA, GQA or MQA as this repository's code (modeling_lrkv.py), not NanoChat")
    args = parser.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here needs the network: transformers must not try it
    t0, out = time.perf_counter(), Path(args.out_dir)
    try:
        check_environment()
        if out.exists() and not (out.is_dir() and not any(out.iterdir())):
            raise ConfigError(f"{out}: exists and is not an empty folder; give another OUT_DIR")
        ckpt, model = load_checkpoint(args.ckpt, "cpu")
        tok = load_tokenizer(args.ckpt, ckpt)
        say_an_older_tokenizer_record(args.ckpt, ckpt["tokenizer"], tok)
        native = check(args.ckpt, tok, model.config, args.native, args.remote_code)
        files = {} if native else model_files(model.config)
    except ConfigError as e:
        print(f"export_hf.py: {e}", file=sys.stderr)
        return 2
    remove_stale(out)
    command = shlex.join(["python", "export_hf.py", *(argv if argv is not None else sys.argv[1:])])
    try:
        write_atomically(out, lambda folder: export(ckpt, model, tok, native, files, folder, command, out))
    except OSError as e:  # a folder on the way is a file, or read-only; a full disk
        where = f" ({e.filename})" if e.filename else ""
        print(f"export_hf.py: {out}: cannot be written: {e.strerror or e}{where}; nothing was written",
              file=sys.stderr)
        return 2
    except Exception as e:  # safetensors' own error for a full disk, "No space left on device"
        if type(e).__name__ != "SafetensorError":
            raise
        print(f"export_hf.py: {out}: cannot be written: {' '.join(str(e).split())}; nothing was written",
              file=sys.stderr)
        return 2
    kind = ("NanoChatForCausalLM (native)" if native
            else "LRKVForCausalLM (remote code, trust_remote_code=True)")
    print(f"{out}: {model.config.attn} as {kind}, in {time.perf_counter() - t0:.1f} s")
    return 0


def say_an_older_tokenizer_record(path, record, tok):
    """One line on stderr where the checkpoint's tokenizer record (its data's meta.json) lacks the vocabulary
    size or the end-of-text id, or has them of another type or value than the tokenizer of its name: the
    export takes that tokenizer's, as sample.py reads such a record."""
    lacking = [f"{field}={record.get(field)!r}" for field, ours in (("vocab_size", tok.vocab_size),
                                                                  ("eot_id", tok.eot_id))
               if type(record.get(field)) is not int or record[field] != ours]
    if lacking:
        print(f"export_hf.py: {path}: its tokenizer record has {', '.join(lacking)}: exported as the "
              f"{tok.name!r} tokenizer's, {tok.vocab_size} tokens, end-of-text id {tok.eot_id}",
              file=sys.stderr)


def check(path, tok, config, native, remote_code):
    """Whether the export is native (NanoChatForCausalLM), or a ConfigError where the checkpoint
    cannot be exported as asked. tok: the checkpoint's tokenizer; config: its GPTConfig."""
    if tok.vocab_size > config.vocab_size:
        raise ConfigError(f"{path}: its tokenizer has {tok.vocab_size} tokens, its model {config.vocab_size}")
    flags = layout_flags(config)  # NanoChat has neither shared keys nor windows
    if native and (flags or config.attn not in NATIVE + NATIVE_IF_ASKED):
        raise ConfigError(f"--native: {' '.join([f'--attn={config.attn}', *flags])} is not expressible as "
                          f"NanoChatForCausalLM (only {', '.join(NATIVE + NATIVE_IF_ASKED)}, without --cla, "
                          "--yoco or --window); drop --native for the remote-code export")
    return native or (not remote_code and not flags and config.attn in NATIVE)


def layout_flags(config):
    """The flags, as train.py takes them, by which some layer reads another's keys and values or has
    a window: [] where every layer computes its own and sees every position."""
    layers, flags = range(config.n_layer), []
    if any(kv_source(config, layer) != layer for layer in layers):
        flags += [f"--cla={config.cla}"] * (config.cla > 1) + ["--yoco"] * config.yoco
    if any(layer_window(config, layer) is not None for layer in layers):
        flags += [f"--window={config.window}", f"--window_pattern={config.window_pattern}"]
    return flags


# The model's code, as the folder holds it

def model_files(config):
    """{name: source} of the files the folder's model runs: model.py, lib/attention's ring.py and layout.py,
    the file of the variant's class (model.py, rivals.py, or one of your own) and every file of
    lib/attention/ they import, each import of model or lib.attention made relative (the folder is one
    package); and "variant": the class's path there where model.py does not define it (a variant that
    model.VARIANTS names at run time, or by a path of its own). A ConfigError where one of them imports
    what the folder cannot hold: anything but torch, Python's own modules, model.py and lib/attention."""
    cls = attention_class(config.attn)
    own = Path(inspect.getsourcefile(cls)).resolve()
    queue, files = [*ALWAYS, own], {}
    while queue:
        path = queue.pop(0)
        if path.stem in files:
            continue
        text = path.read_text()
        files[path.stem] = relative(path, text, queue)
    files["model"] = files["model"].replace('LIB = "lib.attention."', 'LIB = "."')
    return files, None if own == ALWAYS[0] else f"{own.stem}.{cls.__name__}"


def relative(path, text, queue):
    """path's source text with its imports of model and lib.attention made relative to the folder, the
    files of those it imports put on queue; a ConfigError for an import the folder cannot hold."""
    lines = text.splitlines(keepends=True)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names
                                     if node.module == "lib.attention"]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if name == "model":
                queue.append(ALWAYS[0])
            elif name.startswith("lib.attention."):
                queue.append(REPO / "lib" / "attention" / f"{name.split('.')[2]}.py")
            elif name != "lib.attention" and top != "torch" and top not in sys.stdlib_module_names:
                raise ConfigError(f"{path}: imports {name}, which an exported folder cannot hold (it holds "
                                  "model.py and lib/attention/'s files, and needs torch and transformers)")
        if any(name == "model" or name.startswith("lib.attention") for name in names):
            line = lines[node.lineno - 1]
            line = re.sub(r"^(\s*)from model import", r"\1from .model import", line)
            line = re.sub(r"^(\s*)import model$", r"\1from . import model", line)
            line = re.sub(r"^(\s*)from lib\.attention\.(\w+) import", r"\1from .\2 import", line)
            line = re.sub(r"^(\s*)from lib\.attention import", r"\1from . import", line)
            lines[node.lineno - 1] = line
    return "".join(lines)


def modeling_file(modules):
    """hf/modeling_lrkv.py, and an import of each file beside it, so that transformers copies them all
    where it runs the folder's code (it copies what a file imports relatively, and no other)."""
    imports = "".join(f"from .{name} import __name__ as _{name}  # noqa: F401, E402\n" for name in modules)
    return (MODELING.read_text() + "\n\n# The files beside this one that the model runs, as export_hf.py "
            "copied them\n" + imports)


def remove_stale(out):
    """Remove the temporary folders that an export to out killed midway left beside it, saying so."""
    for stale in out.parent.glob(f".{out.name}.*") if out.parent.is_dir() else []:
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
            print(f"export_hf.py: removed {stale}, left by an export to {out} that did not finish",
                  file=sys.stderr)


def write_atomically(out, write):
    """Call write(folder) on a new temporary folder beside out, then rename it to out. Anything
    that fails removes the temporary folder, and the folders above out that this made."""
    made = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    # named before it is made, so that a Ctrl-C while it is made (or while its parents are) leaves nothing
    tmp = out.parent / f".{out.name}.{secrets.token_hex(8)}"
    while tmp.exists():  # not another's
        tmp = out.parent / f".{out.name}.{secrets.token_hex(8)}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(mode=0o700)
        write(tmp)
        # the folder is private while it is written, and so is a file or two that transformers writes: the
        # export is for whoever may read the folder it goes into
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        os.rename(tmp, out)  # replaces out where it is an empty folder, fails where it has been filled since
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in made:  # deepest first
            if folder.exists():
                folder.rmdir()
        raise


def export(ckpt, model, tok, native, files, folder, command, out):
    """Write the model, its code (remote code), the tokenizer, the card and the licence into folder."""
    # imported here, not at the top: most bad input is refused before transformers' seconds of import
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    c, eot = model.config, tok.eot_id
    if native:
        hf = native_model(model, eot)
        hf.save_pretrained(folder)
    else:
        sources, variant = files
        for name, text in sources.items():
            (folder / f"{name}.py").write_text(text)
        (folder / "modeling_lrkv.py").write_text(modeling_file(sources))
        code = {file.name: hashlib.sha256(file.read_bytes()).hexdigest()
                for file in sorted(folder.glob("*.py"))}
        write_config(folder, c, eot, variant, next(model.parameters()).dtype, code)
        weights = {f"model.gpt_model.{name}": w.contiguous() for name, w in model.state_dict().items()}
        # the weights record the model_args they were exported with (and their SHA-256) and the code files'
        # SHA-256: the folder's code refuses a config.json that differs, naming the field, rather than build
        # another model around them, and a code file whose digest is not config.json's, naming the file
        model_args = json.dumps(dataclasses.asdict(c))
        save_file(weights, folder / "model.safetensors",
                  metadata={"format": "pt", "model_args": model_args, "code_sha256": json.dumps(code),
                            "model_args_sha256": hashlib.sha256(model_args.encode()).hexdigest()})
    # generate stops at end-of-text, as sample.py does, and draws no id the tokenizer lacks (a
    # vocabulary padded for fast matmuls: GPT-2's 50257 tokens in 50304 rows)
    padding = list(range(tok.vocab_size, c.vocab_size))
    GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                     suppress_tokens=padding or None).save_pretrained(folder)
    try:
        tokenizer(tok, c.block_size, native).save_pretrained(folder)
    except Exception as e:  # the tokenizers library raises a bare Exception for an OS error (a full disk)
        if type(e) is not Exception:
            raise
        raise OSError(" ".join(str(e).split())) from None
    if not native:  # the tokenizer's class is the folder's own too, which says which transformers it needs
        record = json.loads((folder / "tokenizer_config.json").read_text())
        record["auto_map"] = {"AutoTokenizer": [None, "modeling_lrkv.LRKVTokenizer"]}
        (folder / "tokenizer_config.json").write_text(json.dumps(record, indent=2) + "\n")
    (folder / "README.md").write_text(card(ckpt, model, tok, native, command, out))
    shutil.copyfile(REPO / "LICENSE", folder / "LICENSE")


def write_config(folder, c, eot, variant, dtype, code):
    """config.json of the remote code: the checkpoint's model_args, which model.GPTConfig checks when the
    folder loads, the end-of-text it reads every sequence after, where the variant's class is, and code,
    {file: SHA-256} of the folder's code, which it checks too."""
    import transformers
    config = {"architectures": ["LRKVForCausalLM"], "model_type": "lrkv",
              "auto_map": {"AutoConfig": "modeling_lrkv.LRKVConfig", "AutoModel": "modeling_lrkv.LRKVModel",
                           "AutoModelForCausalLM": "modeling_lrkv.LRKVForCausalLM"},
              "model_args": dataclasses.asdict(c), "eot_id": eot, "variant": variant, "code_sha256": code,
              "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot, "tie_word_embeddings": False,
              "dtype": str(dtype).removeprefix("torch."),
              "transformers_version": transformers.__version__}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def native_model(model, eot):
    """NanoChatForCausalLM holding the checkpoint's weights, each mapped to exactly one of its own.
    NanoChat is this backbone: RMSNorm without weights on the embedding, before every sublayer, on
    queries and keys and before lm_head; ReLU^2; RoPE turning dims i and i + d_h/2 as model.py's
    does. It normalises after RoPE, model.py before it: the same, a rotation keeping the RMS."""
    from transformers import NanoChatConfig, NanoChatForCausalLM

    c = model.config
    config = NanoChatConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=4 * c.n_embd,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
        num_key_value_heads={"mha": c.n_head, "mqa": 1, "gqa": c.n_kv_head, "lrkv": c.n_head}[c.attn],
        max_position_embeddings=c.block_size, hidden_act="relu2",
        # model.py's norm is F.rms_norm with eps=None: the eps of the dtype it computes in, fp32's
        rms_norm_eps=torch.finfo(torch.float32).eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        final_logit_softcapping=None,  # nanochat's soft cap: this model has none
        # no pad id: NanoChat's embedding would take it as padding_idx, whose row never trains, and every id
        # is a token (end-of-text among them, before every text); generate pads with end-of-text
        # (generation_config.json), the tokenizer too, and a pad's label should be -100
        attention_bias=False, tie_word_embeddings=False, bos_token_id=eot, eos_token_id=eot,
        pad_token_id=None)
    with torch.device("meta"):
        hf = NanoChatForCausalLM(config)
    hf.load_state_dict(native_weights(model), strict=True, assign=True)  # strict: none of theirs left empty
    return hf


def native_weights(model):
    """model's weights under NanoChatForCausalLM's names, or a ValueError naming any left unmapped."""
    c = model.config
    ours = dict(model.state_dict())
    theirs = {"model.embed_tokens.weight": ours.pop("wte.weight"),
              "lm_head.weight": ours.pop("lm_head.weight")}
    for i in range(c.n_layer):
        a, m = f"blocks.{i}.attn.", f"model.layers.{i}."
        theirs[m + "self_attn.q_proj.weight"] = ours.pop(a + "W_q.weight")
        if c.attn == "lrkv":  # every head's W_h = W_shared + U_h B_h^T, as heads.py composes it
            with torch.no_grad():
                k, v = (W.flatten(0, 1) for W in head_kv_weights(model.blocks[i].attn))  # (H d_h, d) each
            for name in ("W_shared_k.weight", "W_shared_v.weight", "U_k.weight", "U_v.weight", "B_k", "B_v"):
                ours.pop(a + name)
        else:
            k, v = ours.pop(a + "W_k.weight"), ours.pop(a + "W_v.weight")
        theirs[m + "self_attn.k_proj.weight"], theirs[m + "self_attn.v_proj.weight"] = k, v
        theirs[m + "self_attn.o_proj.weight"] = ours.pop(a + "W_o.weight")
        theirs[m + "mlp.fc1.weight"] = ours.pop(f"blocks.{i}.mlp.W_in.weight")
        theirs[m + "mlp.fc2.weight"] = ours.pop(f"blocks.{i}.mlp.W_out.weight")
    if ours:
        raise ValueError(f"weights with no place in NanoChatForCausalLM: {', '.join(ours)}")
    return theirs


# The tokenizer: the data's, as tokenizers' byte-level BPE. The remote code reads every sequence after
# an end-of-text itself, so its tokenizer adds none (lm-eval then scores a text as eval.py does, its
# rolling log-likelihood too); NanoChat does not, so a native folder's tokenizer puts one before every
# text, as sample.py and eval.py put it (every training document starts with it)

def tokenizer(tok, block_size, native):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    eot = tok.eot_id
    symbol = byte_symbols()
    if tok.name == "byte":
        # one token a byte, its id the byte; NUL is end-of-text, so a NUL in a text has no token
        # (tokenizers drops a symbol outside the vocabulary), as prepare_data.py drops it
        vocab = {symbol[b]: b for b in range(256) if b != eot}
        merges, regex = [], False
    else:
        ranks = gpt2_ranks()
        vocab = {"".join(symbol[b] for b in token): rank for token, rank in ranks.items()}
        merges, regex = gpt2_merges(ranks), True
    vocab[EOT] = eot
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[tuple("".join(symbol[b] for b in part) for part in pair)
                                                    for pair in merges]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex)  # GPT-2's regex
    bpe.decoder = decoders.ByteLevel()
    if native:
        bpe.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B",
                                                           special_tokens=[(EOT, eot)])
    # split_special_tokens: a text that spells <|endoftext|> is encoded as text, as prepare_data.py does;
    # padding on the left, as generate needs a batch
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOT, eos_token=EOT, pad_token=EOT,
                                   model_max_length=block_size - (not native), split_special_tokens=True,
                                   padding_side="left")


def byte_symbols():
    """GPT-2's printable stand-in for each byte, which byte-level BPE vocabularies are written in:
    the byte's own character where it is printable, else chr(256 + n) for the n-th of the others."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def gpt2_ranks():
    """{token's bytes: rank} from gpt2.tiktoken, one `base64 rank` a line."""
    lines = GPT2_RANKS.read_bytes().splitlines()
    return {base64.b64decode(token): int(rank) for token, rank in map(bytes.split, lines)}


def gpt2_merges(ranks):
    """BPE's merges, in rank order, from tiktoken's ranks: a token of rank n is the merge of the two
    parts that BPE leaves of its bytes when only merges ranked below n may apply."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:  # merge the lowest-ranked adjacent pair ranked below the token, as BPE does
            best, i = min((ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:])))
            if best >= rank:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append(parts)
        elif len(parts) > 2:
            raise ValueError(f"{GPT2_RANKS}: token {rank} is no merge of two tokens ranked below it")
    return merges


# The model card

def layout(c):
    """The card's two lines: which positions each layer sees, and whose keys and values it reads."""
    from lib.attention.layout import kv_source, layer_window

    def these(layers, verb):
        one = len(layers) == 1
        return f"layer{'' if one else 's'} {', '.join(map(str, layers))} {verb}{'s' if one else ''}"

    local = [layer for layer in range(c.n_layer) if layer_window(c, layer) is not None]
    seen = "every layer sees every position before it"
    if local:
        seen = (f"{these(local, 'see')} only the last {c.window} positions (`--window={c.window} "
                f"--window_pattern={c.window_pattern}`, tiled over the layers, the last layer always L); "
                "the others every position before them")
    readers = {}  # owner: the other layers that read its keys and values
    for layer in range(c.n_layer):
        if kv_source(c, layer) != layer:
            readers.setdefault(kv_source(c, layer), []).append(layer)
    shared = "every layer computes its own"
    if readers:
        flags = " ".join([f"--cla={c.cla}"] * (c.cla > 1) + ["--yoco"] * c.yoco)
        shared = f"shared (`{flags}`): " + "; ".join(f"{these(them, 'read')} layer {owner}'s"
                                                     for owner, them in readers.items())
    return f"- Windows: {seen}.\n- Keys and values: {shared}."


def peft_names(model, native):
    """The card's names for PEFT, each once in order: the blocks' linear layers, which target_modules takes
    (and "all-linear" adapts: every nn.Linear but the output layer), as the folder's class names them (a
    native folder's: NanoChat's, native_weights'); and the blocks' bare parameters, which no linear layer
    holds and all-linear leaves (LRKV's B_k and B_v)."""
    if native:
        linears = [name.split(".")[-2] for name in native_weights(model) if name.startswith("model.layers.")]
        return list(dict.fromkeys(linears)), []
    linears = [name.split(".")[-1] for name, m in model.blocks.named_modules()
               if isinstance(m, torch.nn.Linear)]
    bare = [name.split(".")[-1] for name, p in model.blocks.named_parameters()
            if not isinstance(model.blocks.get_submodule(name.rpartition(".")[0]), torch.nn.Linear)]
    return list(dict.fromkeys(linears)), list(dict.fromkeys(bare))


SHAPE = ("n_layer", "n_head", "head_dim", "n_embd", "vocab_size", "block_size")  # every variant's
LAYOUT = ("cla", "yoco", "window", "window_pattern")  # the card's layout lines say these


def own_fields(c):
    """The integer fields of GPTConfig c, beside SHAPE's and LAYOUT's, that the variant reads: those some
    change of which (up or down) changes the shapes of its weights or of its cache (on the meta device)."""
    from model import GPT

    def shapes(config):
        with torch.device("meta"):
            gpt = GPT(config)
        return {n: tuple(w.shape) for n, w in gpt.state_dict().items()}, gpt.kv_cache_bytes(1, 1)

    found, made = [], shapes(c)
    for field in dataclasses.fields(c):
        value = getattr(c, field.name)
        if field.name in SHAPE + LAYOUT or type(value) is not int:
            continue
        for other in (2 * value, value + 1, value - 1, value // 2):
            try:
                if shapes(dataclasses.replace(c, **{field.name: other})) != made:
                    found.append(field.name)
                    break
            except ValueError:  # a value the variant refuses
                continue
    return found


def card(ckpt, model, tok, native, command, out):
    """README.md: the Hub's YAML header (licence, library, pipeline, tags), then what the model is (its
    own fields), how it loads (a snippet for the folder at out), what it caches, its limits and how it
    was made."""
    c, cfg = model.config, ckpt.get("config") if isinstance(ckpt.get("config"), dict) else {}
    meta = ckpt["tokenizer"] if isinstance(ckpt.get("tokenizer"), dict) else {}
    dtype = next(model.parameters()).dtype
    dtypes = [dtype] + [torch.bfloat16] * (dtype != torch.bfloat16)  # the weights' and bf16
    names = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16", torch.float64: "fp64"}

    def in_dtypes(per_dtype):  # "N bytes per token in fp32, M in bf16"
        return ", ".join(f"{per_dtype(d):,}{' bytes per token' * (i == 0)} in {names[d]}"
                         for i, d in enumerate(dtypes))

    requirement = transformers_requirement()
    trust = "" if native else ", trust_remote_code=True"
    limits = [f"The context: {c.block_size - (not native)} tokens of a sequence's own"
              + ("; transformers' `generate` goes past it, on positions the model never trained on" if native
                 else f" (block_size {c.block_size}, one of them the end-of-text every sequence is read "
                 "after); a longer sequence is refused in one line, and `generate` stops at the context (a "
                 "prompt's pads counted) keeping what it made, with one warning line")]
    if native:
        load = "from_pretrained(folder)`, no remote code: transformers' NanoChatForCausalLM"
        held = (lambda d: model.kv_cache_bytes(1, 1, d)) if c.attn != "lrkv" else \
            (lambda d: 2 * c.n_layer * c.n_embd * d.itemsize)  # every head's key and value: MHA's
        cache = f"transformers' DynamicCache, {in_dtypes(held)}"
        if c.attn == "lrkv":
            cache += (f": every head's full key and value (MHA's), not LRKV's "
                      f"{model.kv_cache_bytes(1, 1, dtypes[-1]):,} in bf16: export without --native to keep "
                      "LRKV's cache")
        reading = (f"The tokenizer puts end-of-text (id {tok.eot_id}) before every text, as every training "
                   "document starts with it; so lm-eval's rolling log-likelihood scores that one token too "
                   "(export with --remote_code to read texts as this repository does)")
        limits.append("transformers' own class: no code of the lrkv repository runs, so a config.json edited "
                      "by hand but keeping every shape loads as another model")
    else:
        load = ("from_pretrained(folder, trust_remote_code=True)`, or `AutoModel`: the code beside this "
                "card, the lrkv repository's model.py run through modeling_lrkv.py")
        cache = (f"LRKVCache, what this repository's decoder caches: "
                 f"{in_dtypes(lambda d: model.kv_cache_bytes(1, 1, d))} (model.kv_cache_bytes)")
        full = model.kv_cache_bytes(1, c.block_size, torch.bfloat16)
        if full < c.block_size * model.kv_cache_bytes(1, 1, torch.bfloat16):
            cache += (f"; a layer whose readers all have a window keeps only its last {c.window} positions, "
                      f"so a whole context of {c.block_size} tokens holds {full:,} bytes in bf16, not "
                      f"{c.block_size * model.kv_cache_bytes(1, 1, torch.bfloat16):,}")
            limits.append("Its cache cannot be cropped (a window's ring forgets what it passes): assisted "
                          "and prompt-lookup decoding are refused in one line")
        reading = (f"The model reads every sequence after an end-of-text (id {tok.eot_id}), as every "
                   "training document starts with one, and the tokenizer adds none: a text is scored and "
                   "continued as this repository's sample.py and eval.py do, by lm-eval too")
        limits += ["It attends through SDPA and caches with its LRKVCache: another `attn_implementation` or "
                   "`cache_implementation` (`static`) is refused in one line, and so are attention weights "
                   "(`output_attentions`). `inputs_embeds` are read after the end-of-text's embedding. Under "
                   "`torch.compile` its forward is one graph (docs/export.md)",
                   "Trained through transformers (`Trainer`, gradient checkpointing), a left-padded row's "
                   "first token is predicted by the pad before it, as by the end-of-text: give pads the "
                   "label -100"]
    vocabulary = ("GPT-2's byte-pair encoding, 50,257 tokens (OpenAI, MIT licence)" if tok.name == "gpt2"
                  else "one token a byte, 256")
    steps, batch = ckpt.get("step"), cfg.get("batch_size")
    known = isinstance(steps, int) and isinstance(batch, int)
    tokens = f", {steps * batch * c.block_size:,} tokens" if known else ""
    val = ckpt.get("val_loss")
    flags = layout_flags(c)
    own = own_fields(c)
    dimensions = ", ".join(f"{k} {getattr(c, k)}" for k in SHAPE)
    dimensions += (f"; its own: {', '.join(f'{k} {getattr(c, k)}' for k in own)}" if own else "")
    dimensions += f"; rope_theta {c.rope_theta}"
    linears, bare = peft_names(model, native)
    tuning = (f"`target_modules` names {', '.join(f'`{n}`' for n in linears)} (each block's linear layers, "
              "what `\"all-linear\"` adapts, `lm_head` aside")
    tuning += (f"; {', '.join(f'`{n}`' for n in bare)}, bare parameters that all-linear leaves: train them "
               "whole beside the adapters (`requires_grad_()` after `get_peft_model`, and save the model), "
               "as PEFT 0.22's `target_parameters` stops at its own error on a module holding a `W_q`, "
               "HQQ's name)" if bare else ")")
    tuning += ("; prompt tuning reads `hidden_size` and the other sizes from the config" if not native
               else "; NanoChat's names, not the lrkv repository's (`W_q`, ...)")
    tags = "".join(f"- {tag}\n" for tag in ["lrkv", f"attention-{c.attn}", *(["custom_code"] * (not native))])
    limitations = "".join(f"- {line}.\n" for line in limits)
    return f"""---
license: mit
library_name: transformers
pipeline_tag: text-generation
tags:
{tags}---

# {c.attn}{f" ({' '.join(flags)})" if flags else ""}: a GPT of the lrkv repository

Attention `--attn={c.attn}`, {model.get_num_params():,} parameters in {names.get(dtype, dtype)}: {dimensions}.

- Load: `AutoModelForCausalLM.{load}; the tokenizer likewise, `AutoTokenizer`. Needs `{requirement}`.
{layout(c)}
- Cache: {cache}.
- Fine-tuning with PEFT: {tuning}.
- Tokenizer: {vocabulary}, end-of-text id {tok.eot_id}, padding on the left. {reading}.
- Training: data `{cfg.get("data_dir", "?")}` ({meta.get("source", "?")}), {steps} steps{tokens}.
- Validation loss: {f"{val:.4f}" if isinstance(val, float) else "not recorded"} nats per token.
- Made by: `{command}`
- Licence: MIT (LICENSE), the code and these weights.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

folder = "{out}"
model = AutoModelForCausalLM.from_pretrained(folder{trust})
tok = AutoTokenizer.from_pretrained(folder{trust})
ids = tok("def parse(text):", return_tensors="pt")
print(tok.decode(model.generate(**ids, max_new_tokens=50, do_sample=False)[0], skip_special_tokens=True))
```

Limitations:

{limitations}
Log-likelihoods and greedy tokens equal the repository's model.py (docs/export.md).
"""


if __name__ == "__main__":
    sys.exit(run_main(main))
