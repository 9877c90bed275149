{# params: name, n, s, w, el, lanes #}
{#
  The batched generator's KV write in place: (cache [N, S, W] el, rows [T, W] el, slots,
  positions: i32 [T], T: index) -> the cache with row t written at (slots[t],
  positions[t]) (W = KV x D, the row's heads side by side). One workgroup a row, `lanes`
  elements a vector load and store (W % lanes == 0). The cache binding is the dispatch's
  tied result: no other binding holds it, nothing else of it is read or written.
#}
%% import "lib.mlir" as lib
%% set ct = "memref<%dx%dx%dx%s>" % (n, s, w, el)
%% set rt = "memref<?x%dx%s>" % (w, el)
%% set vt = "vector<%dx%s>" % (lanes, el)
%% call lib.executable(name, "%bc: !stream.binding, %br: !stream.binding, %bs: !stream.binding, %bp: !stream.binding, %m: index", per_group=1)
      %c0 = arith.constant 0 : index
      %cw = arith.constant {{ w }} : index
      %cl = arith.constant {{ lanes }} : index
      %cache = stream.binding.subspan %bc[%c0] : !stream.binding -> {{ ct }}
      %rows = stream.binding.subspan %br[%c0] : !stream.binding -> {{ rt }}{%m}
      %sl = stream.binding.subspan %bs[%c0] : !stream.binding -> memref<?xi32>{%m}
      %ps = stream.binding.subspan %bp[%c0] : !stream.binding -> memref<?xi32>{%m}
      %t = stream.dispatch.workgroup.id[0] : index
      %s32 = memref.load %sl[%t] : memref<?xi32>
      %p32 = memref.load %ps[%t] : memref<?xi32>
      %slot = arith.index_cast %s32 : i32 to index
      %pos = arith.index_cast %p32 : i32 to index
      scf.for %c = %c0 to %cw step %cl {
        %v = vector.load %rows[%t, %c] : {{ rt }}, {{ vt }}
        vector.store %v, %cache[%slot, %pos, %c] : {{ ct }}, {{ vt }}
      }
%% endcall
