{# rows_prologue: the index constants of a row kernel and the rows [%r0, %r1) of this
   workgroup, `rows` rows a workgroup out of %m. #}
%% macro rows_prologue(rows)
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c8 = arith.constant 8 : index
      %crows = arith.constant {{ rows }} : index
      %wg = stream.dispatch.workgroup.id[0] : index
      %r0 = arith.muli %wg, %crows : index
      %r1u = arith.addi %r0, %crows : index
      %r1 = arith.minui %r1u, %m : index
%% endmacro
