#!/usr/bin/env bash
# Build bitnet.cpp (Microsoft's BitNet inference engine) for `bench/lm.py --bitnet-cpp OUT`.
#
#   git clone --recursive https://github.com/microsoft/BitNet /path/to/BitNet
#   bash bench/build_bitnet_cpp.sh /path/to/BitNet /work/peers/bitnet.cpp/build
#   python bench/lm.py --bitnet-cpp /work/peers/bitnet.cpp/build
#
# Does what BitNet's setup_env.py does on x86 for the bitnet_b1_58-large shape (the
# bench's model), without its model download or its `pip install` of the llama.cpp
# fork's gguf-py (which would replace the gguf package tercomp uses):
#   1. utils/codegen_tl2.py writes the TL2 kernels for the model's three projection
#      shapes into SRC/include (setup_env.py's BM/BK/bm for bitnet_b1_58-large);
#   2. cmake with -DBITNET_X86_TL2=ON, clang, Release; the one build runs both I2_S
#      and TL2 files (setup_env.py always builds it so on x86);
#   3. OUT/source links to SRC: the bench reads the converter's TL2 packing
#      (utils/convert-hf-to-gguf-bitnet.py), include/kernel_config.ini and the fork's
#      gguf-py (which writes TL2 tensors) from there.
# Only the tools the bench runs are built: llama-quantize (f32 -> I2_S),
# llama-batched-bench (prefill then decode in one context), llama-embedding (the
# logits check), and llama-bench and llama-cli for use by hand.
#
# Tested with BitNet 4645960 (2024-11-08) and its llama.cpp submodule at 406a5036 (the
# Eddie-Wang1120 fork); later BitNet commits move the kernels and may need other steps.
# Needs clang (apt-get install clang), cmake and python3 with numpy. Builds with
# JOBS=2 parallel jobs unless told otherwise.
set -euo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 BITNET_SRC OUT_BUILD_DIR" >&2
    exit 2
fi
SRC=$(cd "$1" && pwd)
OUT=$2
JOBS=${JOBS:-2}

if [ ! -f "$SRC/3rdparty/llama.cpp/CMakeLists.txt" ]; then
    echo "$SRC/3rdparty/llama.cpp is empty: clone with --recursive, or" \
         "run 'git submodule update --init' in $SRC" >&2
    exit 1
fi
for tool in clang clang++ cmake python3; do
    command -v "$tool" >/dev/null || { echo "$tool not found (clang: apt-get install clang)" >&2; exit 1; }
done

# 1. TL2 kernels for the bench's shapes (M x K: 1536x4096, 1536x1536, 4096x1536); an
#    unchanged header keeps its time stamp, so a second run rebuilds nothing
KEEP=$(mktemp -d)
trap 'rm -rf "$KEEP"' EXIT
for f in bitnet-lut-kernels.h kernel_config.ini; do
    if [ -f "$SRC/include/$f" ]; then cp -p "$SRC/include/$f" "$KEEP/"; fi
done
(cd "$SRC" && python3 utils/codegen_tl2.py --model bitnet_b1_58-large \
    --BM 256,128,256 --BK 96,192,96 --bm 32,32,32)
for f in bitnet-lut-kernels.h kernel_config.ini; do
    if cmp -s "$KEEP/$f" "$SRC/include/$f"; then touch -r "$KEEP/$f" "$SRC/include/$f"; fi
done

# 2. configure and build
cmake -S "$SRC" -B "$OUT" -DCMAKE_BUILD_TYPE=Release -DBITNET_X86_TL2=ON \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
cmake --build "$OUT" --config Release -j "$JOBS" \
    --target llama-quantize llama-batched-bench llama-embedding llama-bench llama-cli

# 3. where the bench finds the converter, the kernel config and the fork's gguf-py
ln -sfn "$SRC" "$OUT/source"
echo "built: $(ls "$OUT/bin")"
