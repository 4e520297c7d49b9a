-- Every collective of a GroupCoordinator against a reference, on the world
-- group and on a subgroup, for any number of ranks (run through weft-run).
-- WEFT_TEST_BACKEND=store forces the store path for host tensors.
local U = require("helpers.group_util")
local weft, ffi = U.weft, U.ffi
local T = weft.tensor
local ok, check, same, data = U.ok, U.check, U.same, U.data

local backend = os.getenv("WEFT_TEST_BACKEND")
local world = weft.init { backend = backend ~= "" and backend or nil }
local W, me = world.world_size, world.rank

local function run_suite(g, label)
  local n, r = g.world_size, g.rank_in_group
  local ranks = g.ranks

  -- all_reduce: every reducible dtype and op, exact integer data
  local shape = { 3, 5 }
  for _, dt in ipairs({ "f32", "f16", "bf16", "f64", "i32", "i64", "u8" }) do
    for _, rop in ipairs({ "sum", "max", "min", "prod" }) do
      local lo, hi = -3, 3
      if dt == "u8" then lo = 0 end
      if rop == "prod" then lo, hi = (dt == "u8") and 1 or -1, 2 end
      local x = data(shape, dt, ranks[r + 1], 1, lo, hi)
      local all = {}
      for i = 1, n do local _, v = data(shape, dt, ranks[i], 1, lo, hi); all[i] = v end
      local want = {}
      for e = 1, #all[1] do
        local acc = all[1][e]
        for i = 2, n do
          local v = all[i][e]
          if rop == "sum" then acc = acc + v elseif rop == "max" then acc = math.max(acc, v)
          elseif rop == "min" then acc = math.min(acc, v) else acc = acc * v end
        end
        if dt == "u8" then acc = acc % 256 end
        want[e] = acc
      end
      local res = g:all_reduce(x, rop ~= "sum" and rop or nil)
      check(res == x, "all_reduce returns its input")
      same(x:to_table(), want, ("%s all_reduce %s %s"):format(label, dt, rop))
    end
  end
  ok(label .. " all_reduce dtypes x ops")

  -- a large all_reduce (several shm chunks), random bf16 vs an f64 reference
  do
    local big = { 1024, 1536 }  -- 3 MiB of bf16
    local x = T.randn(big, "bf16", nil, { seed = 100 + ranks[r + 1] })
    local ref = T.zeros(big, "f64")
    local rp = ffi.cast("double *", ref.ptr)
    for i = 1, n do
      local d = T.randn(big, "bf16", nil, { seed = 100 + ranks[i] }):to("f64")
      local dp = ffi.cast("double *", d.ptr)
      for e = 0, ref.numel - 1 do rp[e] = rp[e] + dp[e] end
      d:free()
    end
    g:all_reduce(x)
    local max_abs = x:compare(ref)
    check(max_abs <= 0.0625 * math.max(1, n / 2), "%s big bf16 all_reduce error %g", label, max_abs)
    -- every rank holds bit-identical results
    local sums = g:all_gather_object(ffi.string(x.ptr, 64) .. ffi.string(ffi.cast("uint8_t *", x.ptr) + x.nbytes - 64, 64))
    for i = 2, #sums do check(sums[i] == sums[1], "%s: ranks disagree on the big all_reduce", label) end
  end
  ok(label .. " large bf16 all_reduce")

  -- all_gather along every dim, allocated and into a provided output
  local s3 = { 2, 3, 4 }
  for dim = -3, 2 do
    local d0 = dim < 0 and dim + 3 or dim
    local x = data(s3, "f32", ranks[r + 1], 2)
    local all = {}
    for i = 1, n do local _, v = data(s3, "f32", ranks[i], 2); all[i] = v end
    local want = U.concat(all, s3, d0)
    local out = g:all_gather(x, dim)
    local oshape = { s3[1], s3[2], s3[3] }
    oshape[d0 + 1] = oshape[d0 + 1] * n
    same(out.shape, oshape, label .. " all_gather shape")
    same(out:to_table(), want, ("%s all_gather dim %d"):format(label, dim))
    local into = T.full(oshape, -99, "f32")
    check(g:all_gather(x, dim, into) == into, "all_gather returns the given output")
    same(into:to_table(), want, ("%s all_gather into dim %d"):format(label, dim))
  end
  do -- default dim is -1, and the _into_tensor form is dim 0
    local x = data({ 2, 2 }, "i32", ranks[r + 1], 3)
    check(g:all_gather(x).shape[2] == 2 * n, "default all_gather dim is the last")
    local out = T.empty({ 2 * n, 2 }, "i32")
    g:all_gather_into_tensor(out, x)
    local all = {}
    for i = 1, n do local _, v = data({ 2, 2 }, "i32", ranks[i], 3); all[i] = v end
    same(out:to_table(), U.concat(all, { 2, 2 }, 0), label .. " all_gather_into_tensor")
  end
  ok(label .. " all_gather every dim")

  -- reduce_scatter along every dim
  for _, dt in ipairs({ "f32", "bf16", "i32", "u8" }) do
    for dim = 0, 2 do
      local sh = { 2, 3, 2 }
      sh[dim + 1] = sh[dim + 1] * n
      local lo = dt == "u8" and 0 or -3
      local x = data(sh, dt, ranks[r + 1], 4, lo)
      local sum
      for i = 1, n do
        local _, v = data(sh, dt, ranks[i], 4, lo)
        if not sum then sum = v else for e = 1, #v do sum[e] = sum[e] + v[e] end end
      end
      local want = U.chunk(sum, sh, dim, n, r)
      local out = g:reduce_scatter(x, dim)
      local osh = { sh[1], sh[2], sh[3] }
      osh[dim + 1] = osh[dim + 1] / n
      same(out.shape, osh, label .. " reduce_scatter shape")
      same(out:to_table(), want, ("%s reduce_scatter %s dim %d"):format(label, dt, dim))
    end
  end
  do
    local x = data({ 2 * n, 3 }, "f32", ranks[r + 1], 5)
    local out = T.empty({ 2, 3 }, "f32")
    g:reduce_scatter_tensor(out, x)
    local sum
    for i = 1, n do
      local _, v = data({ 2 * n, 3 }, "f32", ranks[i], 5)
      if not sum then sum = v else for e = 1, #v do sum[e] = sum[e] + v[e] end end
    end
    same(out:to_table(), U.chunk(sum, { 2 * n, 3 }, 0, n, r), label .. " reduce_scatter_tensor")
    local mx = g:reduce_scatter(x, 0, nil, "max")
    local want = {}
    for i = 1, n do
      local _, v = data({ 2 * n, 3 }, "f32", ranks[i], 5)
      for e = 1, #v do want[e] = want[e] and math.max(want[e], v[e]) or v[e] end
    end
    same(mx:to_table(), U.chunk(want, { 2 * n, 3 }, 0, n, r), label .. " reduce_scatter max")
  end
  ok(label .. " reduce_scatter every dim")

  -- broadcast from every source, gather to every destination
  for src = 0, n - 1 do
    local x = data({ 4, 3 }, "bf16", ranks[r + 1], 6)
    local _, want = data({ 4, 3 }, "bf16", ranks[src + 1], 6)
    check(g:broadcast(x, src) == x, "broadcast returns its input")
    same(x:to_table(), want, ("%s broadcast from %d"):format(label, src))
  end
  for dst = 0, n - 1 do
    local x = data({ 2, 3 }, "i64", ranks[r + 1], 7)
    local out = g:gather(x, dst, 0)
    if r == dst then
      local all = {}
      for i = 1, n do local _, v = data({ 2, 3 }, "i64", ranks[i], 7); all[i] = v end
      same(out:to_table(), U.concat(all, { 2, 3 }, 0), ("%s gather to %d"):format(label, dst))
    else
      check(out == nil, "gather returns nil off the destination")
    end
  end
  ok(label .. " broadcast and gather from/to every rank")

  -- send/recv around the ring, both forms of recv, default peers
  if n > 1 then
    local nxt, prv = (r + 1) % n, (r - 1) % n
    local x = data({ 3, 4 }, "f16", ranks[r + 1], 8)
    local _, want = data({ 3, 4 }, "f16", ranks[prv + 1], 8)
    if r % 2 == 0 then
      g:send(x, nxt)
      local got = g:recv({ 3, 4 }, prv, "f16")
      same(got:to_table(), want, label .. " recv by shape")
    else
      local into = T.zeros({ 3, 4 }, "f16")
      check(g:recv(into, prv) == into, "recv fills the given tensor")
      same(into:to_table(), want, label .. " recv into tensor")
      g:send(x, nxt)
    end
    if r % 2 == 0 then g:send(x) ; same(g:recv({ 3, 4 }, nil, "f16"):to_table(), want, "default peers")
    else local got = g:recv({ 3, 4 }, nil, "f16"); g:send(x); same(got:to_table(), want, "default peers") end
    ok(label .. " send/recv ring")
  end

  -- all_to_all_single: equal chunks, then uneven splits
  do
    local rows = 2 * n
    local x = data({ rows, 3 }, "f32", ranks[r + 1], 9)
    local out = T.empty({ rows, 3 }, "f32")
    g:all_to_all_single(out, x)
    local want = {}
    for i = 1, n do
      local _, v = data({ rows, 3 }, "f32", ranks[i], 9)
      for e = r * 6 + 1, r * 6 + 6 do want[#want + 1] = v[e] end
    end
    same(out:to_table(), want, label .. " all_to_all_single equal")
    -- rank i sends (j + i) % 3 + 1 rows to rank j
    local function rows_from(i, j) return (j + i) % 3 + 1 end
    local ins, total_in = {}, 0
    for j = 0, n - 1 do ins[j + 1] = rows_from(r, j); total_in = total_in + ins[j + 1] end
    local outs, total_out = {}, 0
    for i = 0, n - 1 do outs[i + 1] = rows_from(i, r); total_out = total_out + outs[i + 1] end
    local xi = data({ total_in, 2 }, "i32", ranks[r + 1], 10)
    local xo = T.empty({ total_out, 2 }, "i32")
    g:all_to_all_single(xo, xi, { input = ins, output = outs })
    want = {}
    for i = 0, n - 1 do
      local tin = 0
      for j = 0, n - 1 do tin = tin + rows_from(i, j) end
      local _, v = data({ tin, 2 }, "i32", ranks[i + 1], 10)
      local off = 0
      for j = 0, r - 1 do off = off + rows_from(i, j) end
      for e = off * 2 + 1, (off + rows_from(i, r)) * 2 do want[#want + 1] = v[e] end
    end
    same(xo:to_table(), want, label .. " all_to_all_single uneven")
  end
  ok(label .. " all_to_all_single")

  g:barrier()
  ok(label .. " barrier")

  -- objects
  local obj = { rank = ranks[r + 1], name = g.unique_name, list = { 1, 2.5, "x\0y", true }, big = 2 ^ 60 }
  for src = 0, n - 1 do
    local got = g:broadcast_object(r == src and { from = src, payload = obj } or nil, src)
    check(got.from == src and got.payload.list[3] == "x\0y", "%s broadcast_object from %d", label, src)
  end
  local all = g:all_gather_object(obj)
  check(#all == n, "all_gather_object size")
  for i = 1, n do check(all[i].rank == ranks[i] and all[i].big == 2 ^ 60, "%s all_gather_object entry %d", label, i) end
  if n > 1 then
    local nxt, prv = (r + 1) % n, (r - 1) % n
    if r % 2 == 0 then
      g:send_object({ hello = ranks[r + 1], t = data({ 2 }, "f32", 1, 1) }, nxt)
      local got = g:recv_object(prv)
      check(got.hello == ranks[prv + 1] and T.is_tensor(got.t), "%s recv_object", label)
    else
      local got = g:recv_object(prv)
      check(got.hello == ranks[prv + 1] and T.is_tensor(got.t), "%s recv_object", label)
      g:send_object({ hello = ranks[r + 1], t = data({ 2 }, "f32", 1, 1) }, nxt)
    end
  end
  ok(label .. " object collectives")

  -- tensor dicts
  do
    local src = n - 1
    local d
    if r == src then
      d = { a = data({ 2, 3 }, "bf16", 5, 5), b = "meta", c = 42, e = T.empty({ 0, 4 }, "f32"),
            [7] = data({ 5 }, "i64", 6, 6), nested = { x = 1 } }
    end
    local got = g:broadcast_tensor_dict(d, src)
    check(got.b == "meta" and got.c == 42 and got.nested.x == 1, "%s tensor dict values", label)
    same(got.a:to_table(), select(2, data({ 2, 3 }, "bf16", 5, 5)), label .. " tensor dict a")
    same(got[7]:to_table(), select(2, data({ 5 }, "i64", 6, 6)), label .. " tensor dict [7]")
    check(got.e.numel == 0 and got.e.shape[2] == 4, "%s empty tensor in dict", label)
    if n > 1 then
      local nxt, prv = (r + 1) % n, (r - 1) % n
      local mine = { t = data({ 4, n }, "f32", ranks[r + 1], 11), k = "v" .. r, odd = data({ 3 }, "f32", ranks[r + 1], 12) }
      local got2
      if r % 2 == 0 then
        g:send_tensor_dict(mine, nxt)
        got2 = g:recv_tensor_dict(prv)
      else
        got2 = g:recv_tensor_dict(prv)
        g:send_tensor_dict(mine, nxt)
      end
      check(got2.k == "v" .. prv, "%s send/recv tensor dict value", label)
      same(got2.t:to_table(), select(2, data({ 4, n }, "f32", ranks[prv + 1], 11)), label .. " send/recv tensor dict")
      same(got2.odd:to_table(), select(2, data({ 3 }, "f32", ranks[prv + 1], 12)), label .. " tensor dict odd")
    end
    -- the seed's send-allgather: pairs {0,1} -> {2,3} (like TP=2 pipeline
    -- stages); each sender sends its pair-slice, the receiving pair all-gathers
    if label == "world" and n >= 4 and n % 2 == 0 then
      local pair = weft.create_custom_group({ r - r % 2, r - r % 2 + 1 }, "pair")
      local t4 = data({ 4, 6 }, "f32", 42, 13)
      local odd = data({ 3 }, "f32", 42, 14)
      if r < 2 then
        g:send_tensor_dict({ t = t4, odd = odd, tag = "ag" }, r + 2, pair)
      elseif r < 4 then
        local got3 = g:recv_tensor_dict(r - 2, pair)
        check(got3.tag == "ag", "send-allgather value")
        same(got3.t:to_table(), t4:to_table(), "send-allgather tensor")
        same(got3.odd:to_table(), odd:to_table(), "send-allgather odd-sized tensor")
      end
      pair:destroy()
    end
  end
  ok(label .. " tensor dicts")

  -- fused all-reduce + residual + RMSNorm against an f64 reference
  for _, dt in ipairs({ "f32", "bf16" }) do
    local tokens, hidden, eps = 3, 64, 1e-5
    local x = T.randn({ tokens, hidden }, dt, nil, { seed = 300 + ranks[r + 1] })
    local x_before = x:to_table()
    local res = T.randn({ tokens, hidden }, dt, nil, { seed = 7 })
    local w = T.rand({ hidden }, dt, nil, { seed = 8 })
    local y, ro = g:fused_allreduce_rmsnorm(x, res, w, eps)
    same(x:to_table(), x_before, label .. " fused leaves its input alone")
    local sum = {}
    for i = 1, n do
      local v = T.randn({ tokens, hidden }, dt, nil, { seed = 300 + ranks[i] }):to_table()
      for e = 1, #v do sum[e] = (sum[e] or 0) + v[e] end
    end
    -- the all-reduced value is rounded to the dtype first, as any backend does
    sum = T.from_table(sum, "f64", { tokens, hidden }):to(dt):to_table()
    local rv, wv = res:to_table(), w:to_table()
    local tol = dt == "f32" and 1e-4 or 3e-2
    local yv, rov = y:to_table(), ro:to_table()
    for t = 0, tokens - 1 do
      local ss = 0
      for h = 1, hidden do local v = sum[t * hidden + h] + rv[t * hidden + h]; ss = ss + v * v end
      local inv = 1 / math.sqrt(ss / hidden + eps)
      for h = 1, hidden do
        local e = t * hidden + h
        local rr = sum[e] + rv[e]
        check(math.abs(rov[e] - rr) <= tol * (1 + math.abs(rr)), "%s fused residual %s [%d]: %g vs %g", label, dt, e, rov[e], rr)
        local yy = rr * inv * wv[h]
        check(math.abs(yv[e] - yy) <= tol * (1 + math.abs(yy)), "%s fused norm %s [%d]: %g vs %g", label, dt, e, yv[e], yy)
      end
    end
  end
  ok(label .. " fused_allreduce_rmsnorm")
end

run_suite(world, "world")

-- a subgroup: the even ranks (a group of one when W <= 2)
local evens = {}
for i = 0, W - 1, 2 do evens[#evens + 1] = i end
local sub = weft.create_custom_group(evens, "evens")
if sub.is_member then run_suite(sub, "evens") end
-- a group of one rank per process: the bypass of every collective
local solo = weft.create_custom_group({ me }, "solo" .. me)
run_suite(solo, "solo")

world:barrier()
weft.shutdown()
ok("shutdown")
