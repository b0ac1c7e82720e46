#!/usr/bin/env bash
# Wheels that bench_real_gpu.py and bench_sampler.py --real need on a GPU machine that cannot
# reach a package index (the device tool's machines: Python 3.12, x86-64, torch, psutil,
# pandas and scikit-learn already there). Run here, from the repository root; the wheels land
# in .whl/ (ignored by git through .git/info/exclude), which the device call carries:
#
#   bash bench/hardware/device_wheels.sh
#   device run, carry [".whl"]:
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD &&
#     python3 bench/hardware/bench_real_gpu.py --out $OUT/real_gpu.md &&
#     python3 bench/sampling/bench_sampler.py --real --gpus 1 --duration 10 --repeat 2 | tee $OUT/sampler.md
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    anyio==4.16.0 msgspec==0.22.0 aiofiles pyzmq==27.3.0 nvidia-ml-py==13.615.71 zstandard \
    typing-extensions idna \
    zeus==0.16.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types typing-inspection \
    tyro docstring-parser shtab typeguard amdsmi
du -sh .whl
