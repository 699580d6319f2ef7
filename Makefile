# make demo: the paper's six head-diversity models at CPU size on the embedded corpus, then the figures.
# make docs: the demo's figures into docs/ for the README. make test: the whole test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO := out/demo
DEMO_DATA := data/pydocs-byte/meta.json

# the six runs of the paper's figures, at the demo's head dim of 32 (r 16 and 64 of 128 -> 4 and 16)
RUNS := mha lrkv-r4 lrkv-r16 mqa mla gqa
FLAGS_mha := --attn=mha
FLAGS_lrkv-r4 := --attn=lrkv --lrkv_rank=4
FLAGS_lrkv-r16 := --attn=lrkv --lrkv_rank=16
FLAGS_mqa := --attn=mqa
FLAGS_mla := --attn=mla
FLAGS_gqa := --attn=gqa

.PHONY: demo docs test
.DELETE_ON_ERROR:

$(VENV)/installed: requirements.txt requirements-fineweb.txt requirements-dev.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

test: $(VENV)/installed
	$(PY) -m pytest -q

$(DEMO_DATA): | $(VENV)/installed
	$(PY) prepare_data.py --dataset=pydocs --tokenizer=byte

$(DEMO)/%/ckpt.pt: $(DEMO_DATA)
	$(PY) train.py config/demo.py $(FLAGS_$*) --out_dir=$(DEMO)/$*

demo: $(foreach run,$(RUNS),$(DEMO)/$(run)/ckpt.pt)
	$(PY) analyze.py $^ --out_dir=$(DEMO)
	@echo "figures and analysis.json in $(DEMO)/; the table is above"

# the README's figures are the demo's
docs: demo
	mkdir -p docs
	cp $(DEMO)/effective_rank.png $(DEMO)/head_correlation.png docs/
