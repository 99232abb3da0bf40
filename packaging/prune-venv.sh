#!/usr/bin/env bash
# What a service's virtualenv does not need, removed after it is installed from
# requirements.lock; shared by the installer and the Debian package.
#   packaging/prune-venv.sh VENV
# - hf-xet (the hub's chunked transfer for xet-backed repositories: `qvlctl model pull`
#   downloads over plain HTTP through huggingface-hub without it); huggingface-hub and
#   the rest of its stack stay for `model pull`;
# - console scripts other than qvld, qvlctl and python (benchmark_app, ovc, hf, tqdm, ...)
#   and the activate scripts: nobody runs them from a service's venv;
# - OpenVINO's GPU and NPU plugins and its GPU kernel cache, its model frontends other
#   than IR (qvld reads IR; ONNX graphs go to ONNX Runtime), its C++ headers and its
#   tools package: qvld runs on the CPU plugin alone;
# - the packages' own test suites and type stubs, Pillow's AVIF and font rendering
#   (qvld decodes PNG, JPEG, WebP, GIF and BMP and draws no text);
# - numpy's C headers, f2py and distutils (for building extensions, imported on demand
#   only), and the Python side of OpenVINO's frontends for other frameworks;
# - bytecode caches (compiled again by the installer, or by postinst for the package).
# Python extension modules are stripped of their symbol tables (18 MB). The libraries
# auditwheel vendored (*.libs/) and OpenVINO's libs/ are not: patchelf rewrote them, and
# strip --strip-unneeded corrupts such files (numpy's bundled OpenBLAS then fails to
# load: "ELF load command address/offset not page-aligned", tried here).
set -euo pipefail
venv=$1
site=$(echo "$venv"/lib/python3*/site-packages)
"$venv/bin/python" -m pip uninstall --quiet --yes hf-xet 2>/dev/null
find "$venv/bin" -mindepth 1 -maxdepth 1 \
  ! -name qvld ! -name qvlctl ! -name 'python*' -exec rm -f {} +
ov=$site/openvino
rm -f "$ov"/libs/libopenvino_intel_gpu_plugin.so "$ov"/libs/libopenvino_intel_npu_plugin.so \
  "$ov"/libs/cache.json
for frontend in onnx tensorflow tensorflow_lite pytorch paddle jax gguf; do
  rm -f "$ov"/libs/libopenvino_"$frontend"_frontend.so*
done
rm -rf "$ov/include" "$ov/tools"
for frontend in jax onnx paddle pytorch tensorflow; do
  rm -rf "$ov/frontend/$frontend"
done
rm -rf "$site/numpy/_core/include" "$site/numpy/f2py" "$site/numpy/distutils"
if command -v strip >/dev/null; then
  find "$site" -name '*.so' ! -path "$site/*.libs/*" ! -path "$ov/libs/*" -print0 |
    xargs -0 -r strip --strip-unneeded
fi
find "$site" -type d -name tests -prune -exec rm -rf {} +
find "$site" -name '*.pyi' -delete
rm -f "$site"/PIL/_avif.*.so "$site"/PIL/_imagingft.*.so "$site"/pillow.libs/libavif-*.so* \
  "$site"/pillow.libs/libharfbuzz-*.so* "$site"/pillow.libs/libfreetype-*.so*
find "$venv" -name __pycache__ -type d -prune -exec rm -rf {} +
