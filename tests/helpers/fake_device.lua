-- A pretend GPU for running device code paths on the CPU: install() replaces
-- weft.internal.ffi's C library by a proxy whose device functions (CUDA runtime,
-- graphs, NCCL, the custom all-reduce, the fusion workspace, the norm and
-- strided-copy kernels) work on host memory, so the real Lua layers above
-- them (weft.cuda, weft.tensor, weft.graph, weft.nccl, weft.backends.custom_ar,
-- weft.fusion, weft.backends.device_backends, weft.group) run unchanged. Collectives
-- go through the group's cpu group; "device" operations issued while a
-- graph captures are recorded and run at each replay, in order, and a cpu
-- group collective issued directly during a capture is refused (as the C
-- layer does). Device i is LOCAL_RANK % 2 unless set; 2 devices.
--
-- It checks the plumbing (arguments, layouts, dispatch, capture and replay
-- order), not the kernels: reductions run in f64, in rank order, max/min
-- with NCCL's NaN rule (fmax: a NaN is dropped unless every rank holds one).
-- Must be installed before any other weft module is loaded.
local ffi = require("ffi")

local M = {}

function M.install()
  if package.loaded["weft.fake_device"] then return end
  local real = require("weft.internal.ffi")
  local R = real.C
  local F = {}               -- the fake functions
  local proxy = setmetatable(F, { __index = R })

  local fake_err
  local function fail(rc, msg) fake_err = msg; return rc end
  F.weft_last_error = function()
    if fake_err then local e = fake_err; fake_err = nil; return e end
    return R.weft_last_error()
  end

  local mod = {}
  for k, v in pairs(real) do mod[k] = v end
  mod.C = proxy
  mod.last_error = function() return ffi.string(proxy.weft_last_error()) end
  mod.raise = function(_, op, level)
    error(("weft: %s: %s"):format(op, mod.last_error()), (level or 1) + 1)
  end
  mod.check = function(rc, op, level)
    if rc ~= 0 then error(("weft: %s: %s"):format(op, mod.last_error()), (level or 1) + 1) end
    return rc
  end
  package.loaded["weft.internal.ffi"] = mod
  package.loaded["weft.fake_device"] = M

  local ESTATE, EINVAL = -12, -1
  local F64_CODE = 6
  local ES = { [0] = 4, 2, 2, 4, 8, 1, 8, 1 }
  local function addr(p) return tonumber(ffi.cast("uintptr_t", p)) end

  ---------------------------------------------------------------- capture
  local capturing = nil      -- list of recorded operations while capturing
  local graphs, next_id = {}, 4096
  local function defer(fn)
    if capturing then capturing[#capturing + 1] = fn else fn() end
    return 0
  end
  M.capturing = function() return capturing ~= nil end

  -- cpu groups: a registry by handle, collectives refused during a capture
  local cg = require("weft.cpugroup")
  local registry = setmetatable({}, { __mode = "v" })
  local new = cg.new
  cg.new = function(...)
    local g = new(...)
    registry[addr(g.handle)] = g
    return g
  end
  local probe_store = require("weft.store").open { host = "127.0.0.1", port = 0, server = true, timeout_ms = 1000 }
  local probe = new(probe_store, "fake_probe", { 0 }, 0, 1000)
  local Group = getmetatable(probe)
  probe:destroy()
  probe_store:close()
  for _, name in ipairs { "barrier", "broadcast", "allgather", "allreduce_i64", "send", "recv" } do
    local f = Group[name]
    Group[name] = function(self, ...)
      if capturing then
        error("weft: cpugroup " .. name .. ": refused while this thread captures a CUDA graph (fake device)", 2)
      end
      return f(self, ...)
    end
  end
  -- the raw collectives the fake kernels use at replay (never refused)
  local function raw(g, name, ...)
    local saved = capturing
    capturing = nil
    local r = { pcall(Group[name], g, ...) }
    capturing = saved
    if not r[1] then error(r[2], 0) end
    return unpack(r, 2)
  end
  local function group_of(h)
    local g = registry[addr(h)]
    if not g then error("fake device: unknown cpu group handle") end
    return g
  end

  ---------------------------------------------------------------- devices, memory
  local cur_dev = tonumber(os.getenv("WEFT_DEVICE") or "") or (tonumber(os.getenv("LOCAL_RANK") or "0") % 2)
  local owner = {}           -- address -> device
  F.weft_cuda_device_count = function(n) n[0] = 2; return 0 end
  F.weft_cuda_get_device = function(d) d[0] = cur_dev; return 0 end
  F.weft_cuda_set_device = function(d)
    if capturing then return fail(ESTATE, "cuda set_device: refused while this thread captures a graph") end
    if d < 0 or d > 1 then return fail(EINVAL, "cuda set_device: no device " .. d) end
    cur_dev = d; return 0
  end
  F.weft_cuda_device_name = function(_, buf, len) ffi.copy(buf, "fake-gpu", math.min(9, tonumber(len))); return 0 end
  F.weft_cuda_synchronize = function()
    if capturing then return fail(ESTATE, "cuda synchronize: refused while this thread captures a CUDA graph") end
    return 0
  end
  F.weft_cuda_pointer_device = function(p, d) d[0] = owner[addr(p)] or -1; return 0 end
  F.weft_cuda_malloc = function(p, bytes, dev)
    local q = R.weft_host_alloc(math.max(tonumber(bytes), 64))
    if q == nil then return fail(-5, "cuda alloc: out of (host) memory") end
    p[0] = q
    owner[addr(q)] = dev >= 0 and dev or cur_dev
    return 0
  end
  F.weft_cuda_free = function(p)
    if p == nil then return 0 end
    owner[addr(p)] = nil
    R.weft_host_free(p)
    return 0
  end
  F.weft_cuda_pool_stats_get = function(_, st) ffi.fill(st, ffi.sizeof("weft_cuda_pool_stats")); return 0 end
  F.weft_cuda_pool_trim = function() return 0 end
  F.weft_cuda_memcpy = function(dst, src, n)
    if capturing then return fail(ESTATE, "cuda copy: refused while this thread captures a CUDA graph") end
    ffi.copy(dst, src, n); return 0
  end
  F.weft_cuda_memcpy_async = function(dst, src, n) return defer(function() ffi.copy(dst, src, n) end) end
  F.weft_cuda_memset = function(p, v, n) return defer(function() ffi.fill(p, n, v) end) end
  F.weft_cuda_fill_random = function(p, count, dtype, seed, dist)
    return R.weft_host_fill_random(p, count, dtype, seed, dist)
  end
  -- the NaN pass of float max/min (kernels/devops.cu): the bits tested and
  -- written as the kernels do
  -- (words, never doubles: LuaJIT's GC64 interpreter can crash on raw NaN payloads)
  local NAN_W = { [0] = { "uint32_t *", 0x7fffffff, 0x7f800000, 0x7fc00000 },
                  [1] = { "uint16_t *", 0x7fff, 0x7c00, 0x7e00 },
                  [2] = { "uint16_t *", 0x7fff, 0x7f80, 0x7fc0 },
                  [F64_CODE] = { "uint64_t *", 0x7fffffffffffffffULL, 0x7ff0000000000000ULL,
                                 0x7ff8000000000000ULL } }
  local function nan_args(name, x, mask, dtype)
    if not NAN_W[dtype] then
      return fail(EINVAL, ("cuda %s: dtype %d is not a float dtype (f32, f64, f16, bf16)"):format(name, dtype))
    end
    if x == nil or mask == nil then
      return fail(EINVAL, ("cuda %s: NULL %s"):format(name, x == nil and "data" or "mask"))
    end
    return 0
  end
  F.weft_cuda_nan_mask = function(x, mask, count, dtype)
    count = tonumber(count)
    if count == 0 then return 0 end
    if nan_args("nan_mask", x, mask, dtype) ~= 0 then return EINVAL end
    local m = ffi.cast("uint8_t *", mask)
    local w = NAN_W[dtype]
    local p, abs, inf = ffi.cast(w[1], x), w[2], w[3]
    return defer(function()
      for i = 0, count - 1 do m[i] = bit.band(p[i], abs) > inf and 1 or 0 end
    end)
  end
  F.weft_cuda_nan_fixup = function(x, mask, count, dtype)
    count = tonumber(count)
    if count == 0 then return 0 end
    if nan_args("nan_fixup", x, mask, dtype) ~= 0 then return EINVAL end
    local m = ffi.cast("const uint8_t *", mask)
    local w = NAN_W[dtype]
    local p, q = ffi.cast(w[1], x), w[4]
    return defer(function()
      for i = 0, count - 1 do if m[i] ~= 0 then p[i] = q end end
    end)
  end
  F.weft_cuda_memcpy2d_async = function(dst, dpitch, src, spitch, width, height)
    if dpitch < width or spitch < width then return fail(EINVAL, "cuda copy2d: pitch below the row width") end
    local d, s = ffi.cast("uint8_t *", dst), ffi.cast("const uint8_t *", src)
    return defer(function()
      for r = 0, tonumber(height) - 1 do ffi.copy(d + r * dpitch, s + r * spitch, width) end
    end)
  end
  -- calls made with the deterministic bit, per kind (tests read them)
  M.det_calls = { ar = 0, ar_plain = 0, fusion = 0, fusion_plain = 0, rmsnorm = 0, rmsnorm_plain = 0,
                  quick = {},    -- quick all-reduce calls per codec (0 fp, 1 int8, 2 int4, 3 fp8)
                  quick_fused = {} }   -- fused quick two-shot calls per codec (1 int8, 2 int4, 3 fp8)
  local DC = M.det_calls
  F.weft_cuda_rmsnorm = function(x, res, w, out, res_out, tokens, hidden, dtype, eps, flags)
    if flags >= 4 then return fail(EINVAL, "cuda rmsnorm: unknown flags " .. tonumber(flags)) end
    if flags >= 2 then DC.rmsnorm = DC.rmsnorm + 1 else DC.rmsnorm_plain = DC.rmsnorm_plain + 1 end
    local n = tonumber(tokens) * tonumber(hidden) * ES[dtype]
    return defer(function()
      local tx = R.weft_host_alloc(n)
      ffi.copy(tx, x, n)
      local tr = nil
      if res ~= nil then tr = R.weft_host_alloc(n); ffi.copy(tr, res, n) end
      local rc = R.weft_host_rmsnorm(tx, tr, w, out, res_out, tokens, hidden, dtype, eps, flags % 2)
      R.weft_host_free(tx)
      if tr ~= nil then R.weft_host_free(tr) end
      assert(rc == 0, "fake rmsnorm failed")
    end)
  end

  ---------------------------------------------------------------- streams, graphs
  local cur_stream = nil
  F.weft_cuda_stream_create = function(_, out) next_id = next_id + 16; out[0] = ffi.cast("void *", next_id); return 0 end
  F.weft_cuda_stream_destroy = function() return 0 end
  F.weft_cuda_stream_synchronize = function()
    if capturing then return fail(ESTATE, "cuda stream synchronize: refused while this thread captures a CUDA graph") end
    return 0
  end
  F.weft_cuda_stream_wait_stream = function() return 0 end
  F.weft_cuda_stream_wait_event = function() return 0 end
  -- events: the host clock when the work queued before them ran (timing only)
  local events = {}
  local clock = require("weft.internal.clock")
  F.weft_cuda_event_create = function(_, out) next_id = next_id + 16; out[0] = ffi.cast("void *", next_id); events[next_id] = 0; return 0 end
  F.weft_cuda_event_destroy = function(e) events[addr(e)] = nil; return 0 end
  F.weft_cuda_event_record = function(e)
    local k = addr(e)
    return defer(function() events[k] = tonumber(clock.now_ns()) end)
  end
  F.weft_cuda_event_synchronize = function() return 0 end
  F.weft_cuda_event_elapsed = function(a, b, ms)
    ms[0] = ((events[addr(b)] or 0) - (events[addr(a)] or 0)) / 1e6
    return 0
  end
  F.weft_cuda_stream_set_current = function(s) cur_stream = s; return 0 end
  F.weft_cuda_stream_get_current = function(out) out[0] = cur_stream; return 0 end
  F.weft_cuda_stream_capturing = function(_, c) c[0] = capturing and 1 or 0; return 0 end
  F.weft_cuda_graph_begin = function(s)
    if s == nil then return fail(EINVAL, "graph capture: cannot capture the legacy default stream") end
    if capturing then return fail(ESTATE, "graph capture: the stream is already capturing") end
    capturing = {}
    return 0
  end
  F.weft_cuda_graph_end = function(_, out)
    local ops = capturing
    capturing = nil
    if not ops then return fail(ESTATE, "graph end: the stream is not capturing") end
    next_id = next_id + 16
    graphs[next_id] = ops
    out[0] = ffi.cast("weft_cuda_graph *", next_id)
    return 0
  end
  F.weft_cuda_graph_launch = function(g)
    local ops = graphs[addr(g)]
    if not ops then return fail(EINVAL, "graph launch: unknown graph") end
    for i = 1, #ops do ops[i]() end
    return 0
  end
  F.weft_cuda_graph_destroy = function(g) graphs[addr(g)] = nil; return 0 end

  ---------------------------------------------------------------- collective helpers
  local F64 = 6
  -- reduce `count` elements of dtype at byte offset `off` of every part (rank order) into dst
  local function reduce_parts(dst, parts, off, count, dtype, op)
    if count == 0 then return end
    local acc = ffi.new("double[?]", count)
    local tmp = ffi.new("double[?]", count)
    for r = 1, #parts do
      local src = ffi.cast("const uint8_t *", parts[r]) + off
      assert(R.weft_host_convert(src, dtype, r == 1 and acc or tmp, F64, count) == 0)
      if r > 1 then
        for i = 0, count - 1 do
          local a, b = acc[i], tmp[i]
          -- max/min as NCCL's fmaxf/fminf/__hmax/__hmin: a NaN operand is
          -- dropped (NaN only where every rank holds one)
          if op == 0 then acc[i] = a + b
          elseif op == 1 then acc[i] = (a ~= a or b > a) and b or a
          elseif op == 2 then acc[i] = (a ~= a or b < a) and b or a
          else acc[i] = a * b end
        end
      end
    end
    assert(R.weft_host_convert(acc, F64, dst, dtype, count) == 0)
  end
  -- the fused kernels' sum: n elements of dtype of every part (rank order)
  -- added in f64 from 0; returns the sum and a scratch f64 array of n
  local function f64_sum(parts, dtype, n)
    local sum = ffi.new("double[?]", n)
    local tmp = ffi.new("double[?]", n)
    for r = 1, #parts do
      assert(R.weft_host_convert(ffi.cast("const uint8_t *", parts[r]), dtype, tmp, F64, n) == 0)
      for i = 0, n - 1 do sum[i] = sum[i] + tmp[i] end
    end
    return sum, tmp
  end
  local function bytes_of(p, n) if n == 0 then return "" end return ffi.string(p, n) end
  local function put(dst, off, s) if #s > 0 then ffi.copy(ffi.cast("uint8_t *", dst) + off, s, #s) end end

  ---------------------------------------------------------------- NCCL
  local comms = {}
  local function comm(c) local s = comms[addr(c)]; assert(s, "fake nccl: unknown communicator"); return s end
  F.weft_nccl_version = function(v) v[0] = 22803; return 0 end
  F.weft_nccl_create = function(gh, _, out)
    local g = group_of(gh)
    raw(g, "barrier")                        -- collective, like the real one
    next_id = next_id + 16
    comms[next_id] = { g = g, rank = g.index, size = g.size, device = cur_dev }
    out[0] = ffi.cast("weft_nccl *", next_id)
    return 0
  end
  F.weft_nccl_blocking = function(_, b) b[0] = 1; return 0 end
  F.weft_nccl_set_timeout = function() return 0 end
  F.weft_nccl_destroy = function(c) comms[addr(c)] = nil; return 0 end
  F.weft_nccl_abort = function() return 0 end
  F.weft_nccl_info = function(c, r, n, d)
    local s = comm(c)
    r[0], n[0], d[0] = s.rank, s.size, s.device
    return 0
  end
  F.weft_nccl_synchronize = function() return 0 end
  local function on_dev(s, name, ...)
    for i = 1, select("#", ...) do
      local p = select(i, ...)
      if p ~= nil and owner[addr(p)] ~= nil and owner[addr(p)] ~= s.device then
        return fail(EINVAL, ("nccl %s: buffer on cuda:%d, communicator on cuda:%d"):format(name, owner[addr(p)], s.device))
      end
    end
    return 0
  end
  F.weft_nccl_all_reduce = function(c, inp, out, count, dtype, op)
    local s = comm(c); count = tonumber(count)
    if on_dev(s, "all_reduce", inp, out) ~= 0 then return EINVAL end
    return defer(function()
      local parts = raw(s.g, "allgather", bytes_of(inp, count * ES[dtype]))
      reduce_parts(out, parts, 0, count, dtype, op)
    end)
  end
  F.weft_nccl_all_gather = function(c, inp, out, count, dtype)
    local s = comm(c); local nb = tonumber(count) * ES[dtype]
    if on_dev(s, "all_gather", inp, out) ~= 0 then return EINVAL end
    return defer(function()
      local parts = raw(s.g, "allgather", bytes_of(inp, nb))
      for r = 1, #parts do put(out, (r - 1) * nb, parts[r]) end
    end)
  end
  local function counts_of(s, cp) local t = {}; for i = 0, s.size - 1 do t[i + 1] = tonumber(cp[i]) end; return t end
  F.weft_nccl_all_gatherv = function(c, inp, out, counts, dtype)
    local s = comm(c); local cn = counts_of(s, counts)
    return defer(function()
      local parts = raw(s.g, "allgather", bytes_of(inp, cn[s.rank + 1] * ES[dtype]))
      local off = 0
      for r = 1, #parts do
        assert(#parts[r] == cn[r] * ES[dtype], "fake all_gatherv: size mismatch")
        put(out, off, parts[r]); off = off + #parts[r]
      end
    end)
  end
  F.weft_nccl_reduce_scatter = function(c, inp, out, count_out, dtype, op)
    local s = comm(c); local n = tonumber(count_out)
    return defer(function()
      local parts = raw(s.g, "allgather", bytes_of(inp, s.size * n * ES[dtype]))
      reduce_parts(out, parts, s.rank * n * ES[dtype], n, dtype, op)
    end)
  end
  F.weft_nccl_reduce_scatterv = function(c, inp, out, counts, dtype, op)
    local s = comm(c); local cn = counts_of(s, counts)
    local total, off = 0, 0
    for i = 1, #cn do total = total + cn[i]; if i <= s.rank then off = off + cn[i] end end
    return defer(function()
      local parts = raw(s.g, "allgather", bytes_of(inp, total * ES[dtype]))
      reduce_parts(out, parts, off * ES[dtype], cn[s.rank + 1], dtype, op)
    end)
  end
  F.weft_nccl_broadcast = function(c, inp, out, count, dtype, root)
    local s = comm(c); local nb = tonumber(count) * ES[dtype]
    return defer(function()
      local data = raw(s.g, "broadcast", s.rank == root and bytes_of(inp, nb) or nil, root)
      put(out, 0, data)
    end)
  end
  F.weft_nccl_gather = function(c, inp, out, count, dtype, root)
    local s = comm(c); local nb = tonumber(count) * ES[dtype]
    if s.rank == root and out == nil then return fail(EINVAL, "nccl gather: NULL output on the root") end
    return defer(function()
      local parts = raw(s.g, "allgather", bytes_of(inp, nb))
      if s.rank == root then for r = 1, #parts do put(out, (r - 1) * nb, parts[r]) end end
    end)
  end
  F.weft_nccl_send = function(c, buf, count, dtype, peer)
    local s = comm(c); local nb = tonumber(count) * ES[dtype]
    return defer(function() raw(s.g, "send", bytes_of(buf, nb), peer) end)
  end
  F.weft_nccl_recv = function(c, buf, count, dtype, peer)
    local s = comm(c); local nb = tonumber(count) * ES[dtype]
    return defer(function()
      local data = raw(s.g, "recv", peer)
      assert(#data == nb, ("fake recv: got %d bytes, expected %d"):format(#data, nb))
      put(buf, 0, data)
    end)
  end
  F.weft_nccl_all_to_all = function(c, inp, out, count, sc, rc, dtype)
    local s = comm(c); local es, W = ES[dtype], s.size
    local send, recv = {}, {}
    if sc == nil then
      local chunk = tonumber(count) / W
      for i = 1, W do send[i], recv[i] = chunk, chunk end
    else
      send, recv = counts_of(s, sc), counts_of(s, rc)
    end
    local total = 0
    for i = 1, W do total = total + send[i] end
    return defer(function()
      local ser = require("weft.serialize")
      local parts = raw(s.g, "allgather", ser.encode { data = bytes_of(inp, total * es), send = send })
      local pos = 0
      for r = 1, W do
        local p = ser.decode(parts[r])
        local off = 0
        for k = 1, s.rank do off = off + p.send[k] end
        local n = p.send[s.rank + 1]
        assert(n == recv[r], ("fake all_to_all: rank %d sends %d, expected %d"):format(r - 1, n, recv[r]))
        put(out, pos, p.data:sub(off * es + 1, (off + n) * es))
        pos = pos + n * es
      end
    end)
  end
  F.weft_nccl_group_start = function() return 0 end
  F.weft_nccl_group_end = function() return 0 end

  ---------------------------------------------------------------- custom all-reduce
  local ars = {}
  local function ar_of(h) local s = ars[addr(h)]; assert(s, "fake ar: unknown handle"); return s end
  local why_text = { "fake: one-shot", "fake: two-shot", "fake: flag one-shot", "fake: quick fp",
                     "fake: quick int8", "fake: quick int4", "fake: quick fp8" }
  F.weft_ar_create = function(gh, max_bytes, out)
    local g = group_of(gh)
    if not ({ [2] = true, [4] = true, [6] = true, [8] = true })[g.size] then
      return fail(EINVAL, ("allreduce create (group '%s'): world size %d not supported (2, 4, 6, 8)"):format(g.name, g.size))
    end
    raw(g, "barrier")
    next_id = next_id + 16
    ars[next_id] = { g = g, max_bytes = tonumber(max_bytes), calls = 0 }
    out[0] = ffi.cast("weft_ar *", next_id)
    return 0
  end
  F.weft_ar_destroy = function(h) if h ~= nil then ars[addr(h)] = nil end; return 0 end
  F.weft_ar_info = function(h, r, w, mb, lb, om)
    local s = ar_of(h)
    if r ~= nil then r[0] = s.g.index end
    if w ~= nil then w[0] = s.g.size end
    if mb ~= nil then mb[0] = s.max_bytes end
    if lb ~= nil then lb[0] = math.min(s.max_bytes, 16 * 1048576) end
    if om ~= nil then om[0] = 8 * 1048576 end
    return 0
  end
  local function ar_check(s, count, dtype, algo)
    local es = ({ [0] = 4, 2, 2 })[dtype]
    if not es then return fail(EINVAL, "allreduce: dtype not supported (f32, f16, bf16)") end
    if count == 0 then return fail(EINVAL, "allreduce: count is 0") end
    if count * es > s.max_bytes then return fail(EINVAL, "allreduce: exceeds the workspace") end
    if algo % 256 > 7 or algo >= 1024 then return fail(EINVAL, "allreduce: unknown algorithm") end
    if algo % 256 >= 4 and dtype == 0 then return fail(EINVAL, "allreduce: the quick all-reduce takes bf16 or f16, not f32") end
    return 0, es
  end
  -- C's choice in miniature (src/coll/allreduce.c resolve): "auto" is the
  -- one-shot up to the one-shot limit (weft_ar_info's 8 MiB), else the
  -- two-shot; a named kernel is itself
  F.weft_ar_resolve = function(h, count, dtype, algo, kind, why)
    count = tonumber(count)
    local rc, es = ar_check(ar_of(h), count, dtype, algo)
    if rc ~= 0 then return rc end
    local k = algo % 256
    if k == 0 then k = count * es <= 8 * 1048576 and 1 or 2 end
    kind[0] = k
    if why ~= nil then why[0] = why_text[k] end
    return 0
  end
  F.weft_ar_run = function(h, inp, out, count, dtype, algo)
    local s = ar_of(h)
    count = tonumber(count)
    local rc, es = ar_check(s, count, dtype, algo)
    if rc ~= 0 then return rc end
    if addr(inp) % 16 ~= 0 or addr(out) % 16 ~= 0 then return fail(EINVAL, "allreduce: buffers must be 16-byte aligned") end
    s.calls = s.calls + 1
    M.ar_algos[#M.ar_algos + 1] = algo   -- the code as handed (kernel | flags): 0 would be "auto"
    if algo >= 512 then DC.ar = DC.ar + 1 else DC.ar_plain = DC.ar_plain + 1 end
    local q = algo % 256
    if q >= 4 then DC.quick[q - 4] = (DC.quick[q - 4] or 0) + 1 end
    return defer(function()
      local parts = raw(s.g, "allgather", bytes_of(inp, count * es))
      if q >= 4 then   -- the quick all-reduce: its CPU reference (the kernel's exact bits)
        local ins = ffi.new("const void *[?]", #parts)
        for i = 1, #parts do ins[i - 1] = parts[i] end
        assert(R.weft_qr_reference(q - 4, dtype, #parts, ins, out, count) == 0)
        return
      end
      reduce_parts(out, parts, 0, count, dtype, 0)
    end)
  end
  F.weft_ar_check_error = function() return 0 end
  F.weft_ar_abort = function() return 0 end
  F.weft_ar_set_timeout = function() return 0 end
  M.ar_algos = {}   -- the algorithm code of every weft_ar_run, in order
  M.ar_calls = function() local n = 0; for _, s in pairs(ars) do n = n + s.calls end; return n end

  ---------------------------------------------------------------- fusion
  local fus = {}
  local function fu_of(h) local s = fus[addr(h)]; assert(s, "fake fusion: unknown workspace"); return s end
  F.weft_fusion_preflight = function(_, _, ok) ok[0] = 1; return 0 end
  F.weft_fusion_create = function(gh, o, out)
    local g = group_of(gh)
    raw(g, "barrier")
    next_id = next_id + 16
    fus[next_id] = { g = g, max_tokens = tonumber(o.max_tokens), hidden = tonumber(o.hidden), dtype = o.dtype, runs = 0 }
    out[0] = ffi.cast("weft_fusion *", next_id)
    return 0
  end
  F.weft_fusion_destroy = function(h) if h ~= nil then fus[addr(h)] = nil end; return 0 end
  F.weft_fusion_sufficient = function(h, tokens, hidden, dtype, _, ok)
    local s = fu_of(h)
    ok[0] = (tonumber(tokens) <= s.max_tokens and tonumber(hidden) <= s.hidden and ES[dtype] <= ES[s.dtype]) and 1 or 0
    return 0
  end
  F.weft_fusion_check_error = function() return 0 end
  F.weft_fusion_run = function(h, p)
    local s = fu_of(h)
    local tokens, hidden, dtype = tonumber(p.tokens), tonumber(p.hidden), p.dtype
    if tokens > s.max_tokens or hidden > s.hidden then return fail(EINVAL, "fusion run: larger than the workspace") end
    if hidden % 8 ~= 0 then return fail(EINVAL, "fusion run: hidden must be a multiple of 8") end
    local pattern, flags, eps = p.pattern, p.flags, p.eps
    if flags >= 32 then return fail(EINVAL, "fusion run: unknown flags") end
    if flags >= 16 and flags % 4 < 2 then return fail(EINVAL, "fusion run: deterministic mode needs FP32_ACC") end
    if flags >= 16 then DC.fusion = DC.fusion + 1 else DC.fusion_plain = DC.fusion_plain + 1 end
    local inp, res, w, res_out, norm_out = p.input, p.residual, p.weight, p.residual_out, p.norm_out
    local quant, scale = p.quant_out, p.scale
    if pattern == 2 and (quant == nil or scale == nil) then return fail(EINVAL, "fusion run: FP8 needs quant_out and scale") end
    s.runs = s.runs + 1
    local n, es = tokens * hidden, ES[dtype]
    local quick = p.quick
    if quick ~= 0 then   -- the quick two-shot: its CPU reference (the kernel's residual_out bits)
      if pattern ~= 1 or dtype == 0 or quick > 3 then return fail(EINVAL, "fusion run: quick codec refused") end
      DC.quick_fused[quick] = (DC.quick_fused[quick] or 0) + 1
      return defer(function()
        local parts = raw(s.g, "allgather", bytes_of(inp, n * es))
        local ins = ffi.new("const void *[?]", #parts)
        for i = 1, #parts do ins[i - 1] = parts[i] end
        -- the all-reduced value, then the pretend norm kernel on it (as the unfused path)
        local sum, rc, ro = R.weft_host_alloc(n * es), R.weft_host_alloc(n * es), R.weft_host_alloc(n * es)
        ffi.copy(rc, res, n * es)
        assert(R.weft_qr_fused_reference(quick, dtype, #parts, ins, rc, w, eps, flags % 2, tokens, hidden, sum,
                                         ro, nil) == 0)
        assert(R.weft_host_rmsnorm(sum, rc, w, norm_out, res_out, tokens, hidden, dtype, eps, flags % 2) == 0)
        pcall(ffi.cdef, "int memcmp(const void *a, const void *b, size_t n);")
        assert(ffi.C.memcmp(ro, res_out, n * es) == 0, "fake fused quick: residual_out differs from the reference")
        R.weft_host_free(sum); R.weft_host_free(rc); R.weft_host_free(ro)
      end)
    end
    return defer(function()
      local parts = raw(s.g, "allgather", bytes_of(inp, n * es))
      -- sum in f64 over ranks, + residual, rounded once to dtype
      local sum, tmp = f64_sum(parts, dtype, n)
      assert(R.weft_host_convert(res, dtype, tmp, F64, n) == 0)
      for i = 0, n - 1 do sum[i] = sum[i] + tmp[i] end
      assert(R.weft_host_convert(sum, F64, res_out, dtype, n) == 0)
      local nb = norm_out
      local own = nil
      if nb == nil then own = R.weft_host_alloc(n * es); nb = own end
      assert(R.weft_host_rmsnorm(res_out, nil, w, nb, nil, tokens, hidden, dtype, eps, flags % 2) == 0)
      if pattern == 2 then
        local f = ffi.new("float[?]", n)
        assert(R.weft_host_convert(nb, dtype, f, 0, n) == 0)
        local inv = ffi.new("float[1]")
        inv[0] = 1 / ffi.cast("const float *", scale)[0]
        for i = 0, n - 1 do f[i] = f[i] * inv[0] end
        assert(R.weft_host_convert(f, 0, quant, 7, n) == 0)
      end
      if own ~= nil then R.weft_host_free(own) end
    end)
  end
  M.fusion_runs = function() local n = 0; for _, s in pairs(fus) do n = n + s.runs end; return n end

  ---------------------------------------------------------------- more fusion patterns
  -- (src/coll/fusion_ext.c): the contributions through the real host MoE
  -- reduction, the rank sum in f64 through the cpu group, the norms through
  -- the real host norm; records each run's pattern and algorithm.
  local fxs = {}
  M.fx_runs = {}
  local FX_PATTERN = { "MoE + all-reduce + RMSNorm (fused_moe_allreduce_rmsnorm)",
                       "MoE finalize + all-reduce + RMSNorm (fused_moe_finalize_allreduce_rmsnorm)",
                       "all-reduce + pre/post RMSNorm (fused_allreduce_prepost_rmsnorm)",
                       "reduce-scatter + RMSNorm (fused_reduce_scatter_rmsnorm)" }
  F.weft_cuda_moe_reduce = function(inp, sc, sdt, perm, rows, shared, out, res, w, res_out, norm_out,
                                    tokens, hidden, top_k, dtype, eps, flags)
    local n = tonumber(tokens) * tonumber(hidden)
    local es = ES[dtype]
    if perm ~= nil then
      for i = 0, tonumber(tokens) * top_k - 1 do
        if perm[i] < 0 or perm[i] >= rows then return fail(EINVAL, "fake moe_reduce: permutation out of range (the real kernel writes NaN)") end
      end
    end
    M.moe_reduce_calls = (M.moe_reduce_calls or 0) + 1
    return defer(function()
      local own = nil
      local dst = out
      if dst == nil then own = R.weft_host_alloc(n * es); dst = own end
      assert(R.weft_host_moe_reduce(inp, sc, sdt, perm, rows, shared, dst, tokens, hidden, top_k, dtype) == 0)
      if w ~= nil then
        assert(R.weft_host_rmsnorm(dst, res, w, norm_out, res_out, tokens, hidden, dtype, eps, flags % 2) == 0)
      end
      if own ~= nil then R.weft_host_free(own) end
    end)
  end
  local function fx_of(h) local s = fxs[addr(h)]; assert(s, "fake fusion_ext: unknown workspace"); return s end
  F.weft_fusion_ext_preflight = function(_, _, ok) ok[0] = 1; return 0 end
  F.weft_fusion_ext_create = function(gh, o, out)
    local g = group_of(gh)
    if o.dtype ~= 1 and o.dtype ~= 2 then return fail(EINVAL, "fusion_ext create: dtype (bf16, f16)") end
    raw(g, "barrier")
    next_id = next_id + 16
    fxs[next_id] = { g = g, max_tokens = tonumber(o.max_tokens), hidden = tonumber(o.hidden), runs = 0 }
    out[0] = ffi.cast("weft_fusion_ext *", next_id)
    return 0
  end
  F.weft_fusion_ext_destroy = function(h) if h ~= nil then fxs[addr(h)] = nil end; return 0 end
  F.weft_fusion_ext_sufficient = function(h, tokens, hidden, dtype, _, ok)
    local s = fx_of(h)
    ok[0] = (tonumber(tokens) <= s.max_tokens and tonumber(hidden) <= s.hidden and (dtype == 1 or dtype == 2)) and 1 or 0
    return 0
  end
  F.weft_fusion_ext_check_error = function() return 0 end
  F.weft_fusion_ext_run = function(h, p)
    local s = fx_of(h)
    local W, me = s.g.world_size, s.g.rank_in_group
    local tokens, hidden, dtype, pat = tonumber(p.tokens), tonumber(p.hidden), p.dtype, p.pattern
    if tokens > s.max_tokens or hidden > s.hidden then return fail(EINVAL, "fusion_ext run: larger than the workspace") end
    if dtype ~= 1 and dtype ~= 2 then return fail(EINVAL, "fusion_ext run: dtype") end
    if pat == 4 and tokens % W ~= 0 then return fail(EINVAL, "fusion_ext run: tokens do not divide") end
    if pat == 4 and p.algo == 1 then return fail(EINVAL, "fusion_ext run: reduce-scatter one-shot refused") end
    if p.flags >= 64 then return fail(EINVAL, "fusion_ext run: unknown flags") end
    s.runs = s.runs + 1
    M.fx_runs[#M.fx_runs + 1] = { pattern = pat, algo = p.algo, tokens = tokens }
    local n, es = tokens * hidden, 2
    local gemma = p.flags % 2
    local c = {}
    for _, k in ipairs { "input", "scales", "permutation", "shared_output", "residual", "weight", "weight_pre",
                         "residual_out", "norm_out", "gathered_out" } do c[k] = p[k] end
    local top_k, rows, sdt, eps, eps_pre = p.top_k, p.expert_rows, (p.flags >= 32) and dtype or 0, p.eps, p.eps_pre
    -- a peer that never arrives: the collective's bounded wait fails, named
    -- as the real run names a failed call (group, rank, pattern)
    local okr, rc = pcall(defer, function()
      local part = R.weft_host_alloc(n * es)
      if pat <= 2 then
        local perm = pat == 2 and c.permutation or nil
        local nrows = pat == 2 and rows or top_k * tokens
        assert(R.weft_host_moe_reduce(c.input, c.scales, sdt, perm, nrows, c.shared_output, part, tokens, hidden,
                                      top_k, dtype) == 0)
      else
        ffi.copy(part, c.input, n * es)
      end
      local parts = raw(s.g, "allgather", bytes_of(part, n * es))
      local sum = f64_sum(parts, dtype, n)
      assert(R.weft_host_convert(sum, F64, part, dtype, n) == 0)   -- the sum, rounded
      local rows_out, off = tokens, 0
      if pat == 4 then rows_out = tokens / W; off = me * rows_out * hidden * es end
      local src = ffi.cast("uint8_t *", part) + off
      if pat == 3 then
        local pre = R.weft_host_alloc(n * es)
        assert(R.weft_host_rmsnorm(part, nil, c.weight_pre, pre, nil, tokens, hidden, dtype, eps_pre, gemma) == 0)
        ffi.copy(part, pre, n * es)
        R.weft_host_free(pre)
      end
      assert(R.weft_host_rmsnorm(src, c.residual, c.weight, c.norm_out, c.residual_out, rows_out, hidden, dtype,
                                 eps, gemma) == 0)
      if pat == 4 and c.gathered_out ~= nil then
        local all = raw(s.g, "allgather", bytes_of(c.norm_out, rows_out * hidden * es))
        for r = 1, #all do ffi.copy(ffi.cast("uint8_t *", c.gathered_out) + (r - 1) * rows_out * hidden * es, all[r], rows_out * hidden * es) end
      end
      R.weft_host_free(part)
    end)
    if okr then return rc end
    return fail(-2, ("fusion_ext run (group '%s', rank %d, %s): %s"):format(tostring(s.g.name), me, FX_PATTERN[pat] or "?",
                                                                          tostring(rc)))
  end
  return M
end

return M
