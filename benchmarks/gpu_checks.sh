#!/usr/bin/env bash
# The GPU checks of docs/gpu.md, on a machine with an NVIDIA GPU, cupy and mpi4py (and
# pytest with pytest-mpi), from the repository's root:
#
#     COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_checks.sh [OUT]
#
# writes into OUT (default benchmarks/results/gpu), each file headed by its command:
#   machine.txt          the GPU, driver, cupy, mpi4py and MPI
#   gpu-tests-np2.txt    tests/test_gpu_mpi.py under mpiexec at 2 ranks
#   torch-tests-np2.txt  tests/test_torch_mpi.py under mpiexec at 2 ranks (CUDA tensors
#                        where torch has CUDA)
#   device-parts-np2.txt benchmarks/device_parts.py: a short call on cupy arrays, part by part
#   torch-backend-cuda-np2.txt  benchmarks/torch_backend.py --device cuda (against gloo)
#   verify-cuda-np2.txt  verify --device cuda: every algorithm against MPI.Allreduce
#   bench-cuda-np2.txt   bench --device cuda, 8 B to 16 MiB, side by side with MPI.Allreduce
#   refused-np2.txt      verify --device cuda with the GPU hidden: one usage line a rank,
#                        exit status 2
# Every mpiexec has a time limit (LIMIT seconds, default 400).  ONLY="NAME ..." runs
# those of the checks above alone (machine.txt is always written).
set -uo pipefail
out=${1:-benchmarks/results/gpu}
mkdir -p "$out"
commit=${COMMIT:-unknown}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

record() {  # record NAME COMMAND...: the command, its output and its exit status
    local name=$1; shift
    [[ -z ${ONLY:-} || " $ONLY " == *" $name "* ]] || return 0
    { echo "\$ $*   # commit $commit"; timeout "${LIMIT:-400}" "$@" 2>&1; echo "# exit status $?"; } \
        > "$out/$name.txt"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import cupy, mpi4py; from mpi4py import MPI; print('cupy', cupy.__version__, \
'mpi4py', mpi4py.__version__); print(MPI.Get_library_version().splitlines()[0])"; } \
    > "$out/machine.txt" 2>&1
record gpu-tests-np2 env MPI_ALLREDUCE_UNDER_MPIEXEC=1 mpiexec -n 2 --oversubscribe \
    -x MPI_ALLREDUCE_UNDER_MPIEXEC -x PYTHONPATH python -m pytest --with-mpi -q \
    -p no:cacheprovider tests/test_gpu_mpi.py
record torch-tests-np2 env MPI_ALLREDUCE_UNDER_MPIEXEC=1 mpiexec -n 2 --oversubscribe \
    -x MPI_ALLREDUCE_UNDER_MPIEXEC -x PYTHONPATH python -m pytest --with-mpi -q \
    -p no:cacheprovider tests/test_torch_mpi.py
record device-parts-np2 mpiexec -n 2 --oversubscribe -x PYTHONPATH python \
    benchmarks/device_parts.py
record torch-backend-cuda-np2 mpiexec -n 2 --oversubscribe -x PYTHONPATH python \
    benchmarks/torch_backend.py --device cuda -r 3 -n 50 --ddp-iters 10
record verify-cuda-np2 mpiexec -n 2 --oversubscribe -x PYTHONPATH python -m mpi_allreduce \
    verify --device cuda --no-large
record bench-cuda-np2 mpiexec -n 2 --oversubscribe -x PYTHONPATH python -m mpi_allreduce \
    bench --device cuda -b 8 -e 16M -f 8 -n 20 -c
record refused-np2 env CUDA_VISIBLE_DEVICES= mpiexec -n 2 --oversubscribe -x PYTHONPATH \
    -x CUDA_VISIBLE_DEVICES python -m mpi_allreduce verify --device cuda
