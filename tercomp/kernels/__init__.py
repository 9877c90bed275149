"""The hand-written kernels and the one table that chooses them.

    table.py        every kernel an op can take: (op, kernel, targets, CPU feature,
                    where it fits, how it is emitted, where "auto" picks it, flags,
                    why); the `kernels` pass settles each op from it, the lowering
                    emits the row an op names. Registering a new kernel is a row here.
    host.py         the host CPU's features
    template.py     renders the kernel templates (templates/*.mlir, named parameters)
    ternary/        ternary_matmul: emitters (what each table row emits), strategies
                    (the rows by strategy name: choices, flags, emit_ternary_matmul),
                    builder (TernaryBuilder, the portable addsub/int8/f32 kernels),
                    vnni, blocked, avx512, avx2 and avx2_quant (hand-written dispatches)
    dense/          widening_matmul: widening_avx2 (the f16/int8 output-layer GEMV),
                    vnni_avx512 (int8 tables on int8 activations, vpdpbusd)
    attention/      cached_attention, slot_attention: attention_cpu
    rows/           rms_norm, rope: rows_cpu

The ops keep their generic lowering (tercomp/ops/); the table's kernels replace it per
target. The lowering driver that calls either is tercomp/lowering/driver.py.
"""
