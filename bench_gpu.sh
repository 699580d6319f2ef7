#!/usr/bin/env bash
# What a lent GPU is for, most important first, in at most 8 minutes on one H200, with no network:
#   1. the one-GPU tier end to end: config/gpu.py's 128M MHA and LRKV (r = 16) trained a few steps on
#      the pydocs corpus in GPT-2 tokens (bf16, torch.compile, checkpoints), analyze.py, sample.py;
#   2. decoding, eager and compiled (the fixed-shape step as CUDA graphs), all five variants, 2,048 and
#      8,192 tokens (where reading the cache is most of a step: docs/decoding.md's roofline), batch 16,
#      with the cached-decoding check, after the GPU's ceilings (bf16 matmul FLOP/s, memory bandwidth);
#   3. the training rows of MHA and LRKV, as far as the time left allows (2026-11-30 measured all five).
# Each phase has a time limit and writes its logs and JSON as it goes, so a run cut short keeps what
# it measured. nvidia-smi's process list shows whether anything else shared the GPU.
#
#     ./bench_gpu.sh [out_dir]             # out_dir: default $OUT, else out/gpu
#     TINY=1 ./bench_gpu.sh /tmp/try       # the same steps at toy sizes on a CPU, in a few minutes
set -uo pipefail
case "${1:-}" in -*) echo "bench_gpu.sh: the only argument is the output folder (got $1)" >&2; exit 2 ;; esac
out=$(realpath -m -- "${1:-${OUT:-out/gpu}}")
cd "$(dirname "$0")"
mkdir -p "$out"
python=${PYTHON:-python3}
gpus() { command -v nvidia-smi >/dev/null && nvidia-smi --query-compute-apps=pid,name,used_memory --format=csv >>"$out/gpu_processes.txt" 2>&1; true; }
if [ "${TINY:-}" ]; then
  model=(--n_layer=2 --n_head=2 --head_dim=16 --n_embd=32 --block_size=64 --device=cpu)
  run=(--batch_size=4 --micro_batch_size=4 --max_steps=4 --warmup_steps=1 --eval_interval=2 --eval_tokens=256 --log_interval=1)
  lrkv_rank=4 bench=(--preset=tiny --device=cpu) decode=()
else
  model=() run=(--max_steps=60 --warmup_steps=10 --eval_interval=30 --eval_tokens=4096 --log_interval=10)
  lrkv_rank=16 bench=(--preset=128m) decode=(--contexts=2048,8192)
fi

gpus
pipeline() {
  timeout 25 "$python" prepare_data.py --dataset=pydocs --tokenizer=gpt2 --out_dir="$out/data" || return
  for attn in mha lrkv; do
    timeout 75 "$python" train.py config/gpu.py --attn=$attn --lrkv_rank=$lrkv_rank "${model[@]}" "${run[@]}" \
      --data_dir="$out/data" --out_dir="$out/pipeline/$attn" || return
  done
  timeout 20 "$python" analyze.py "$out/pipeline" \
    && timeout 25 "$python" sample.py "$out/pipeline/lrkv/ckpt.pt" --prompt="def " --max_new_tokens=32
}
pipeline 2>&1 | tee "$out/pipeline.log"
echo "pipeline: exit ${PIPESTATUS[0]}" | tee -a "$out/pipeline.log"
gpus
timeout 200 "$python" bench.py "${bench[@]}" "${decode[@]}" --only=decode --check --peaks \
  --out="$out/decode.json" 2>&1 | tee "$out/decode.log"
echo "decoding: exit ${PIPESTATUS[0]}" | tee -a "$out/decode.log"
gpus
timeout 60 "$python" bench.py "${bench[@]}" --only=train --attn=lrkv --out="$out/train.json" 2>&1 | tee "$out/train.log"
echo "training: exit ${PIPESTATUS[0]}" | tee -a "$out/train.log"
