#!/usr/bin/env bash
# GPU check: the test suite and the four model/op benches, logs into $OUT.
#   bash bench/gpu_check.sh [tests|bench|half|all]      (from the repo root; default all)
# half: only the half-precision model rows (MiniLM f16, SmolLM2 bf16, the 1B-shaped bf16
# decode, ResNet-50 / ViT-B/16 bf16, the bf16 training step) beside torch in the same dtype.
# Half attention's tier 0 needs nvidia-cudnn-frontend 1.14 importable (the GPU image has no
# internet: carry its wheel and pip install --target it onto PYTHONPATH, as numpy's).
# tests takes ~8 min on an H100 (7m45s measured) and bench ~6 min (5.5 measured), so under a
# 10-minute limit per command run "tests" and "bench" as two calls.
# No bench needs real model weights: every model is built from its config with random weights
# from a seed. Needs torch, transformers, torchvision, sentence-transformers, safetensors and
# tokenizers; bench_models' weight-format section also needs gguf (skipped without it).
# Files in $OUT: gpu_tests.log, models.log, train.log, vision.log, attention.log, bench_json.tgz.
set -o pipefail
mode=${1:-all}
case $mode in tests|bench|half|all) ;; *) echo "usage: $0 [tests|bench|half|all]"; exit 2;; esac
OUT=${OUT:-/tmp/gpu_check_out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
J=/tmp/bench_json; rm -rf "$J"; mkdir -p "$J"
rc=0

if [ "$mode" = tests ] || [ "$mode" = all ]; then
  python3 -m compileall -q rlx_numba
  python3 -m pytest -q -n 8 -p no:cacheprovider tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
  r=$?; echo "== tests rc=$r"; [ $r -eq 0 ] || rc=1
fi

# run LOG SECONDS ARGS...: one bench under a timeout, appended to $OUT/LOG; rows printed before
# a timeout stay in the log (the benches flush each row).
run() {
  local log=$1 t=$2; shift 2
  echo "== $* (timeout ${t}s)" | tee -a "$OUT/$log"
  timeout "$t" python3 "$@" 2>&1 | tee -a "$OUT/$log" | tail -15
  local r=$?; echo "== rc=$r: $*" | tee -a "$OUT/$log"; [ $r -eq 0 ] || rc=1
}

if [ "$mode" = half ]; then
  nvidia-smi -L
  run half.log 150 bench/bench_models.py --no-compile --only bert --dtype f16 --out "$J/models_bert_f16.json"
  run half.log 170 bench/bench_models.py --no-compile --only llama --dtype bf16 --out "$J/models_llama_bf16.json"
  run half.log 150 bench/bench_models.py --only decode1b --new 64 --out "$J/models_1b_bf16.json"
  run half.log 120 bench/bench_vision.py --models-only --dtypes bf16 --out "$J/vision_bf16.json"
  run half.log 240 bench/bench_train.py --only llama --precision bf16 --iters 3 --out "$J/train_bf16.json"
  tar -czf "$OUT/bench_json.tgz" -C "$J" .
fi

if [ "$mode" = bench ] || [ "$mode" = all ]; then
  nvidia-smi -L
  # torch.compile columns are skipped (--no-compile), as in the baseline runs: they cost
  # minutes and no bar reads them. Sections run as in the baseline commands.
  run models.log 75 bench/bench_models.py --no-compile --only bert --out "$J/models_bert.json"
  run models.log 170 bench/bench_models.py --no-compile --only llama --out "$J/models_llama.json"
  run models.log 240 bench/bench_models.py --no-compile --only qwen3next --new 64 --out "$J/models_qwen3next.json"
  if python3 -c "import gguf" 2>/dev/null; then
    # q4_0 / q5_0 quantisation goes through the gguf package; the 1B shape's random f32
    # weights (~5 GB on the host) and their quantisation are most of this run's time
    run models.log 150 bench/bench_models.py --only formats --new 64 --out "$J/models_formats.json"
  else
    echo "== SKIPPED bench_models --only formats: no gguf package (carry its wheel)" \
      | tee -a "$OUT/models.log"
  fi
  run train.log 120 bench/bench_train.py --no-compile --profile --iters 3 --out "$J/train.json"
  run vision.log 90 bench/bench_vision.py --out "$J/vision.json"
  run attention.log 60 bench/bench_attention.py --iters 3 --out "$J/attention.json"
  tar -czf "$OUT/bench_json.tgz" -C "$J" .
fi
exit $rc
