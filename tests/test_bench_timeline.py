"""bench/timeline.py: naming a dispatch's kind and weight bytes, and reading IREE's HAL
profile of a real (tiny) module back into per-call times."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import timeline  # noqa: E402  (bench/timeline.py)

VOCAB = 32002


def test_dispatch_kinds_and_bytes():
    k = lambda n: timeline.kind(n, VOCAB)[0]      # noqa: E731
    assert k("tern_avx512_gemv_4096x384_offset_q") == "ternary"
    assert k("tern_avx2_i8_gemv_32002x1536") == "output"
    assert k("tern_slot_attention_16x16x96x8x512_f16") == "attention"
    assert k("tern_attention_16x16x96x512_f16") == "attention"
    assert k("tern_rms_norm_1536") == "rms_norm"
    assert k("tern_avx2_quant_384") == "quantize"
    assert k("tern_amx_gemm_4096x384_offset_q") == "ternary"
    assert k("tern_amx_quant_384") == "quantize"
    assert k("tern_rope_16x96") == "rope"
    assert k("step_dispatch_7_scatter_8x512x16x96xf16_dispatch_tensor_store") == "kv_write"
    assert k("step_dispatch_7_slow_memcpy") == "kv_write"
    assert k("tern_kv_write_8x512x1536_f16") == "kv_write"
    assert k("step_dispatch_12_elementwise_D_f32") == "other"
    # N rows of K/4 bytes (2-bit codes); the output table's rows of K int8 or f16
    assert timeline.weight_bytes("tern_avx512_gemv_4096x384_offset_q") == 4096 * 384
    assert timeline.weight_bytes("tern_amx_gemm_4096x384_offset_q") == 4096 * 384
    assert timeline.weight_bytes("tern_avx2_i8_gemv_32002x1536") == 32002 * 1536
    assert timeline.weight_bytes("tern_avx2_f16_gemv_32002x1536") == 2 * 32002 * 1536
    assert timeline.weight_bytes("tern_rms_norm_1536") == 0


def test_profile_of_a_module_reads_back(tmp_path):
    # two dispatches (an add, then an exp that cannot fuse past the reduction between
    # them) profiled over 9 calls: every call's events come back, named and timed
    from iree.compiler import compile_str
    src = """
    func.func @main(%a: tensor<1048576xf32>) -> (tensor<1048576xf32>, tensor<f32>) {
      %e = math.exp %a : tensor<1048576xf32>
      %z = arith.constant dense<0.0> : tensor<f32>
      %s = linalg.reduce ins(%e : tensor<1048576xf32>) outs(%z : tensor<f32>) dimensions = [0]
        (%x: f32, %acc: f32) { %y = arith.addf %x, %acc : f32
                               linalg.yield %y : f32 }
      return %e, %s : tensor<1048576xf32>, tensor<f32>
    }"""
    vmfb = tmp_path / "m.vmfb"
    vmfb.write_bytes(compile_str(src, target_backends=["llvm-cpu"],
                                 extra_args=["--iree-llvmcpu-target-cpu=host"]))
    prof = str(tmp_path / "p.ireeprof")
    t = timeline.bench_module(str(vmfb), None, None, ["1048576xf32=0.5"], 2, 9, profile=prof,
                              function="main")
    assert 0 < t < 1
    subs = timeline.dispatch_events(prof)
    names, kinds, dsum, span, count, n = timeline.per_call(subs, VOCAB)
    assert n == 9 and sum(count.values()) >= 2
    assert all(name.startswith("main_dispatch_") for name in names)
    # the median of the calls' sums, and the sum of each name's median: near, not equal
    # (dispatches of ~0.1-1 ms: at 4096 elements, a few microseconds each, a scheduling
    # hiccup of 10 us in two of the three calls doubled the median sum; with 3 calls a
    # loaded machine's hiccup in two of them moved the median sum by 50%: 9 calls)
    assert np.isclose(dsum, sum(names.values()), rtol=0.25) and 0 < dsum <= span * 1.5
    assert kinds["other"] == dsum
