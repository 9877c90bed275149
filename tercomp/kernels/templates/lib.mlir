{# Macros every kernel template imports (no parameters of its own). #}
{#
  executable: `stream.executable private @name` with one export `@name` over a workgroup
  count along x: `groups` workgroups; or with `per_group`, ceil(m / per_group) of them;
  or with `times`, m * times;
  or with `few`, `many`, `m_min`: `many` when m >= m_min, else `few`. Its function takes
  `bindings` (stream bindings and scalars; the last one `%m: index`, the workload, whose
  name the export uses too) and runs the body of the call block before `return`;
  `prelude`: text put in the executable's module before the function (constant
  `memref.global`s the body reads by `memref.get_global`).
#}
%% macro executable(name, bindings, groups=none, per_group=none, few=none, many=none, m_min=none, times=none, prelude=none, per_group_small=none)
stream.executable private @{{ name }} {
  stream.executable.export public @{{ name }} workgroups(%m: index) -> (index, index, index) {
    %c1 = arith.constant 1 : index
%% if few is not none
    %few = arith.constant {{ few }} : index
    %many = arith.constant {{ many }} : index
    %mmin = arith.constant {{ m_min }} : index
    %big = arith.cmpi uge, %m, %mmin : index
    %g = arith.select %big, %many, %few : index
%% elif groups is not none
    %g = arith.constant {{ groups }} : index
%% elif times is not none
    %times = arith.constant {{ times }} : index
    %g = arith.muli %m, %times : index
%% elif per_group_small is not none
    %mmin = arith.constant {{ m_min }} : index
    %big = arith.cmpi uge, %m, %mmin : index
    %gbig = affine.apply affine_map<()[s0] -> (s0 ceildiv {{ per_group }})>()[%m]
    %gsmall = affine.apply affine_map<()[s0] -> (s0 ceildiv {{ per_group_small }})>()[%m]
    %g = arith.select %big, %gbig, %gsmall : index
%% else
    %g = affine.apply affine_map<()[s0] -> (s0 ceildiv {{ per_group }})>()[%m]
%% endif
    stream.return %g, %c1, %c1 : index, index, index
  }
  builtin.module {
%% if prelude is not none
{{ prelude }}
%% endif
    func.func @{{ name }}({{ bindings }}) {
{{ caller() }}
      return
    }
  }
}
%% endmacro
{#
  load_row: `dst` = the `vec_type` at column `col` of row `base` + `offset` of `mem`
  (`mem_type`), through the index `row`; with `pre` (an SSA name for the prefetch
  row) the same column `ahead` rows further on is prefetched (past the last row that
  address is in no row: x86 prefetches never fault) with `locality` 0 (prefetchnta) to
  3 (prefetcht0).
#}
%% macro load_row(dst, row, base, offset, col, mem, mem_type, vec_type, pre=none, ahead=0, locality=0)
{{ row }} = affine.apply affine_map<(d0) -> (d0 + {{ offset }})>({{ base }})
{{ dst }} = vector.load {{ mem }}[{{ row }}, {{ col }}] : {{ mem_type }}, {{ vec_type }}
%% if pre is not none
{{ pre }} = affine.apply affine_map<(d0) -> (d0 + {{ ahead }})>({{ row }})
memref.prefetch {{ mem }}[{{ pre }}, {{ col }}], read, locality<{{ locality }}>, data : {{ mem_type }}
%% endif
%% endmacro
