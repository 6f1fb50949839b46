#!/usr/bin/env bash
# The wheels that `python -m bench.gpu` needs on the lent GPU machines beside what their image
# holds (torch, torchvision, torchmetrics, pyarrow, Pillow, PyYAML; not Ray, whose wheel is more
# than a call there may carry), at the lock's versions, into .whl/ (ignored by git). Then
# one call there runs the check (bench/README.md, "On a lent GPU machine").
set -euo pipefail
cd "$(dirname "$0")/.."
pins=()
for name in pydantic pydantic-core annotated-types typing-inspection; do
  pins+=("$(grep -m1 "^${name}==" requirements/cluster.lock | cut -d' ' -f1)")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pins[@]}"
ls .whl
