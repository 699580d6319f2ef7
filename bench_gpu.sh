#!/usr/bin/env bash
# Everything bench.py measures, on one GPU in under 8 minutes: the 128M preset's training rows of
# all five variants with --check first, then their decoding. Each phase is its own bench.py run,
# which rewrites its JSON after every variant, and its log is written as it goes, so a run cut
# short keeps what it measured. nvidia-smi's process list shows whether anything else shared the GPU.
#
#     ./bench_gpu.sh [out_dir] [more bench.py flags]     # out_dir: default $OUT, else out/gpu
#     ./bench_gpu.sh /tmp/try --preset=tiny --device=cpu  # the same steps in seconds on a CPU
set -uo pipefail
case "${1:-}" in -*) echo "bench_gpu.sh: the output folder comes first, then bench.py's flags (got $1)" >&2; exit 2 ;; esac
out=$(realpath -m -- "${1:-${OUT:-out/gpu}}")
shift $(($# > 0 ? 1 : 0))
cd "$(dirname "$0")"
mkdir -p "$out"
python=${PYTHON:-python3}
gpus() { command -v nvidia-smi >/dev/null && nvidia-smi --query-compute-apps=pid,name,used_memory --format=csv >>"$out/gpu_processes.txt" 2>&1; true; }
gpus
# compiling each variant's training step takes most of the first phase; the limits keep the
# second phase's share of the 8 minutes (about 20 s a variant)
timeout 300 "$python" bench.py --preset=128m --check --only=train --attn=lrkv,mla,gqa,mqa --out="$out/train.json" "$@" 2>&1 | tee "$out/train.log"
echo "training: exit ${PIPESTATUS[0]}" | tee -a "$out/train.log"
gpus
timeout 150 "$python" bench.py --preset=128m --only=decode --out="$out/decode.json" "$@" 2>&1 | tee "$out/decode.log"
echo "decoding: exit ${PIPESTATUS[0]}" | tee -a "$out/decode.log"
