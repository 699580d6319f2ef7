# make demo: the paper's six head-diversity models at CPU size on the embedded corpus, then the figures.
# make docs: the demo's figures into docs/ for the README. make test: the whole test suite.
# make demo SEED=1: the same demo from another seed, in its own folder (out/demo-seed1).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SEED ?= 0
seed_suffix := $(if $(filter-out 0,$(SEED)),-seed$(SEED))
DEMO ?= out/demo$(seed_suffix)
# Models this small keep a core busy each; two one-thread runs side by side finish sooner than
# two-thread runs one after another, whose threads mostly wait for each other.
JOBS ?= 2
DEMO_DATA := data/pydocs-byte/meta.json

# the six runs of the paper's figures, at the demo's head dim of 16 (r 16 and 64 of 128 -> 2 and 8)
RUNS := mha lrkv-r2 lrkv-r8 mqa mla gqa
CKPTS := $(foreach run,$(RUNS),$(DEMO)/$(run)/ckpt.pt)
# A run's ckpt.pt exists from its first evaluation on, so make tracks a stamp that only a finished
# run leaves: a run killed midway (even with make itself) starts over next time.
TRAINED := $(CKPTS:ckpt.pt=trained)
FLAGS_mha := --attn=mha
FLAGS_lrkv-r2 := --attn=lrkv --lrkv_rank=2
FLAGS_lrkv-r8 := --attn=lrkv --lrkv_rank=8
FLAGS_mqa := --attn=mqa
FLAGS_mla := --attn=mla
FLAGS_gqa := --attn=gqa

.PHONY: demo docs test gpu-demo
.DELETE_ON_ERROR:

$(VENV)/installed: requirements.txt requirements-fineweb.txt requirements-dev.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

test: $(VENV)/installed
	$(PY) -m pytest -q

$(DEMO_DATA): | $(VENV)/installed
	$(PY) prepare_data.py --dataset=pydocs --tokenizer=byte

# each run's progress goes to its train.out; its last lines are shown when it ends
$(DEMO)/%/trained: $(DEMO_DATA)
	@mkdir -p $(@D)
	@echo "training $* -> $(@D)/train.out"
	@OMP_NUM_THREADS=1 $(PY) train.py config/demo.py $(FLAGS_$*) --seed=$(SEED) --out_dir=$(@D) > $(@D)/train.out \
		|| { tail -n 5 $(@D)/train.out; exit 1; }
	@echo "$*: $$(tail -n 1 $(@D)/train.out)"
	@touch $@

demo: $(DEMO_DATA)
	$(MAKE) --no-print-directory -j$(JOBS) $(TRAINED)
	$(PY) analyze.py $(CKPTS) --out_dir=$(DEMO)
	@echo "figures and analysis.json in $(DEMO)/; the table is above"

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
	$(PY) train.py config/gpu.py $(FLAGS_$*) --seed=$(SEED) --out_dir=$(@D)
	touch $@

gpu-demo: $(GPU_CKPTS:ckpt.pt=trained)
	$(PY) analyze.py $(GPU_CKPTS) --out_dir=$(GPU_DEMO)

# the README's figures are the demo's
docs: demo
	mkdir -p docs
	cp $(DEMO)/effective_rank.png $(DEMO)/head_correlation.png $(DEMO)/loss_curves.png docs/
