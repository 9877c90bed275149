// Generated from tercomp's op registry by `python -m tercomp.ops.irdl`. Do not edit.
irdl.dialect @tern {
  irdl.operation @abs {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @act_quant {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @add {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @arange {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @argmax {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    %2 = irdl.any
    irdl.attributes {"axis" = %1, "keepdims" = %2}
    %3 = irdl.any
    irdl.results(r0: %3)
  }
  irdl.operation @avg_pool {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    %2 = irdl.any
    %3 = irdl.any
    irdl.attributes {"window" = %1, "stride" = %2, "padding" = %3}
    %4 = irdl.any
    irdl.results(r0: %4)
  }
  irdl.operation @broadcast_to {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.attributes {"shape" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @cache_write {
    %0 = irdl.any
    %1 = irdl.any
    %2 = irdl.any
    irdl.operands(x0: %0, x1: %1, x2: %2)
    %3 = irdl.any
    irdl.results(r0: %3)
  }
  irdl.operation @cached_attention {
    %0 = irdl.any
    %1 = irdl.any
    %2 = irdl.any
    %3 = irdl.any
    irdl.operands(x0: %0, x1: %1, x2: %2, x3: %3)
    %4 = irdl.any
    %5 = irdl.any
    irdl.attributes {"scale" = %4, "kernel" = %5}
    %6 = irdl.any
    irdl.results(r0: %6)
  }
  irdl.operation @cast {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.attributes {"dtype" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @checkpoint {
    %0 = irdl.any
    irdl.operands(operands: variadic %0)
    %1 = irdl.region
    irdl.regions(body: %1)
    %2 = irdl.any
    irdl.results(results: variadic %2)
  }
  irdl.operation @concatenate {
    %0 = irdl.any
    irdl.operands(operands: variadic %0)
    %1 = irdl.any
    irdl.attributes {"axis" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @constant {
    irdl.operands()
    %0 = irdl.any
    irdl.attributes {"value" = %0}
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @conv {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    %3 = irdl.any
    %4 = irdl.any
    %5 = irdl.any
    irdl.attributes {"stride" = %2, "padding" = %3, "dilation" = %4, "groups" = %5}
    %6 = irdl.any
    irdl.results(r0: %6)
  }
  irdl.operation @conv_transpose {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    %3 = irdl.any
    %4 = irdl.any
    %5 = irdl.any
    %6 = irdl.any
    irdl.attributes {"stride" = %2, "padding" = %3, "dilation" = %4, "groups" = %5, "output_padding" = %6}
    %7 = irdl.any
    irdl.results(r0: %7)
  }
  irdl.operation @conv_weight_grad {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    %3 = irdl.any
    %4 = irdl.any
    %5 = irdl.any
    %6 = irdl.any
    irdl.attributes {"stride" = %2, "padding" = %3, "dilation" = %4, "groups" = %5, "kernel" = %6}
    %7 = irdl.any
    irdl.results(r0: %7)
  }
  irdl.operation @cos {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @cross_entropy {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @custom_vjp {
    %0 = irdl.any
    irdl.operands(operands: variadic %0)
    %1 = irdl.any
    %2 = irdl.any
    %3 = irdl.any
    %4 = irdl.any
    irdl.attributes {"rule" = %1, "n_outputs" = %2, "n_inputs" = %3, "res_tree" = %4}
    %5 = irdl.any
    irdl.results(results: variadic %5)
  }
  irdl.operation @div {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @eq {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @exp {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @exp2 {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @expand_dims {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.attributes {"axis" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @ge {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @gelu {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @gt {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @im2col {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    %2 = irdl.any
    %3 = irdl.any
    %4 = irdl.any
    irdl.attributes {"kernel" = %1, "stride" = %2, "padding" = %3, "dilation" = %4}
    %5 = irdl.any
    irdl.results(r0: %5)
  }
  irdl.operation @kv_scatter {
    %0 = irdl.any
    %1 = irdl.any
    %2 = irdl.any
    %3 = irdl.any
    irdl.operands(x0: %0, x1: %1, x2: %2, x3: %3)
    %4 = irdl.any
    irdl.attributes {"kernel" = %4}
    %5 = irdl.any
    irdl.results(r0: %5)
  }
  irdl.operation @layer_norm {
    %0 = irdl.any
    %1 = irdl.any
    %2 = irdl.any
    irdl.operands(x0: %0, x1: %1, x2: %2)
    %3 = irdl.any
    irdl.attributes {"eps" = %3}
    %4 = irdl.any
    irdl.results(r0: %4)
  }
  irdl.operation @le {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @log {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @log2 {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @log_softmax {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.attributes {"axis" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @logsumexp {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.attributes {"keepdims" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @lt {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @matmul {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    %3 = irdl.any
    irdl.attributes {"transpose_b" = %2, "kernel" = %3}
    %4 = irdl.any
    irdl.results(r0: %4)
  }
  irdl.operation @matmul_sum {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    irdl.attributes {"kernel" = %2}
    %3 = irdl.any
    irdl.results(r0: %3)
  }
  irdl.operation @max {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.attributes {"keepdims" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @max_pool {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    %2 = irdl.any
    %3 = irdl.any
    irdl.attributes {"window" = %1, "stride" = %2, "padding" = %3}
    %4 = irdl.any
    irdl.results(r0: %4)
  }
  irdl.operation @maximum {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @mean {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.attributes {"keepdims" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @min {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.attributes {"keepdims" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @minimum {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @mul {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @ne {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @neg {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @one_hot {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    %2 = irdl.any
    irdl.attributes {"num_classes" = %1, "dtype" = %2}
    %3 = irdl.any
    irdl.results(r0: %3)
  }
  irdl.operation @pad {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.attributes {"widths" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @pow {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.attributes {"exponent" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @relu {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @reshape {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.attributes {"shape" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @rms_norm {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    %3 = irdl.any
    irdl.attributes {"eps" = %2, "kernel" = %3}
    %4 = irdl.any
    irdl.results(r0: %4)
  }
  irdl.operation @rope {
    %0 = irdl.any
    %1 = irdl.any
    %2 = irdl.any
    irdl.operands(x0: %0, x1: %1, x2: %2)
    %3 = irdl.any
    %4 = irdl.any
    irdl.attributes {"style" = %3, "kernel" = %4}
    %5 = irdl.any
    irdl.results(r0: %5)
  }
  irdl.operation @round {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @rsqrt {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @scan {
    %0 = irdl.any
    irdl.operands(operands: variadic %0)
    %1 = irdl.any
    %2 = irdl.any
    %3 = irdl.any
    %4 = irdl.any
    irdl.attributes {"n_carry" = %1, "n_xs" = %2, "length" = %3, "reverse" = %4}
    %5 = irdl.region
    irdl.regions(body: %5)
    %6 = irdl.any
    irdl.results(results: variadic %6)
  }
  irdl.operation @scatter_add {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    %3 = irdl.any
    irdl.attributes {"axis" = %2, "size" = %3}
    %4 = irdl.any
    irdl.results(r0: %4)
  }
  irdl.operation @sigmoid {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @sign {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @silu {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @sin {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @size {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @slice {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    %2 = irdl.any
    %3 = irdl.any
    %4 = irdl.any
    irdl.attributes {"starts" = %1, "stops" = %2, "steps" = %3, "runtime_offsets" = %4}
    %5 = irdl.any
    irdl.results(r0: %5)
  }
  irdl.operation @slot_attention {
    %0 = irdl.any
    %1 = irdl.any
    %2 = irdl.any
    %3 = irdl.any
    %4 = irdl.any
    irdl.operands(x0: %0, x1: %1, x2: %2, x3: %3, x4: %4)
    %5 = irdl.any
    %6 = irdl.any
    irdl.attributes {"scale" = %5, "kernel" = %6}
    %7 = irdl.any
    irdl.results(r0: %7)
  }
  irdl.operation @softmax {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.attributes {"axis" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @split {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    %2 = irdl.any
    irdl.attributes {"axis" = %1, "sizes" = %2}
    %3 = irdl.any
    irdl.results(r0: %3)
  }
  irdl.operation @sqrt {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @squeeze {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @stop_gradient {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @sub {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @sum {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.attributes {"keepdims" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @take {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    irdl.attributes {"axis" = %2}
    %3 = irdl.any
    irdl.results(r0: %3)
  }
  irdl.operation @tanh {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @ternarize {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.results(r0: %1)
  }
  irdl.operation @ternary_matmul {
    %0 = irdl.any
    %1 = irdl.any
    irdl.operands(x0: %0, x1: %1)
    %2 = irdl.any
    %3 = irdl.any
    %4 = irdl.any
    %5 = irdl.any
    %6 = irdl.any
    irdl.attributes {"k" = %2, "n" = %3, "scale" = %4, "strategy" = %5, "act_quant" = %6}
    %7 = irdl.any
    irdl.results(r0: %7)
  }
  irdl.operation @ternary_pack {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.attributes {"codes" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @ternary_weight {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    %2 = irdl.any
    irdl.attributes {"k" = %1, "scale" = %2}
    %3 = irdl.any
    irdl.results(r0: %3)
  }
  irdl.operation @transpose {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    irdl.attributes {"perm" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @unslice {
    %0 = irdl.any
    irdl.operands(x0: %0)
    %1 = irdl.any
    %2 = irdl.any
    %3 = irdl.any
    %4 = irdl.any
    irdl.attributes {"shape" = %1, "starts" = %2, "stops" = %3, "steps" = %4}
    %5 = irdl.any
    irdl.results(r0: %5)
  }
  irdl.operation @where {
    %0 = irdl.any
    %1 = irdl.any
    %2 = irdl.any
    irdl.operands(x0: %0, x1: %1, x2: %2)
    %3 = irdl.any
    irdl.results(r0: %3)
  }
  irdl.operation @widening_matmul {
    %0 = irdl.any
    irdl.operands(operands: variadic %0)
    %1 = irdl.any
    irdl.attributes {"kernel" = %1}
    %2 = irdl.any
    irdl.results(r0: %2)
  }
  irdl.operation @yield {
    %0 = irdl.any
    irdl.operands(operands: variadic %0)
    irdl.results()
  }
}
